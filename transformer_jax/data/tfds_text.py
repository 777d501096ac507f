"""Loading text corpora from TensorFlow Datasets (TFDS) as lists of Python strings.

TFDS is only used to fetch and read the corpora; tokenizing and batching happen
in NumPy like for the plain-text files. `tensorflow_datasets` is imported inside
the functions because importing TensorFlow takes seconds, and most runs (toy
corpus, text files) never need it.
"""

import typing
from typing import Any

from absl import logging

from transformer_jax.errors import DataError

# Examples are read in batches: TF's per-element overhead dominates otherwise.
_READ_BATCH = 1024


def import_tfds():
  """The `tensorflow_datasets` module; one DataError line naming the extra that installs it.

  TFDS and TensorFlow (about 600 MB) are the `tfds` extra, not a dependency: only the corpora
  read through TFDS need them, not the layers or runs on text files."""
  try:
    import tensorflow_datasets  # lazy: the tfds extra; importing TensorFlow takes seconds
  except ImportError as error:
    raise DataError(f'reading a TFDS corpus needs TensorFlow Datasets ({error}); install the '
                    'tfds extra: pip install -e ".[tfds]"') from None
  return tensorflow_datasets


def _load(name: str, split: str, data_dir: str | None, max_examples: int | None) -> Any:
  """Returns the tf.data.Dataset of a TFDS split, turning failures into a DataError."""
  tfds = import_tfds()

  if max_examples is not None and max_examples < 1:
    raise DataError(f'max_examples must be positive or None, got {max_examples}')
  try:
    dataset = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False)
  except tfds.core.registered.DatasetNotFoundError:
    # TFDS's own message lists every dataset it knows: far too long for one line.
    raise DataError(f'TFDS has no dataset named {name!r}; check the spelling, e.g. '
                    "'wmt14_translate/de-en' or 'lm1b'") from None
  except Exception as e:
    # Downloading and preparing can fail in many ways (no network, missing files,
    # unknown split, missing optional packages); all need the same advice.
    reason = (str(e).strip().splitlines() or [''])[0][:300]
    raise DataError(
        f'cannot load TFDS dataset {name!r} split {split!r} from data_dir='
        f'{data_dir or "the TFDS default (~/tensorflow_datasets)"}: {type(e).__name__}: '
        f'{reason}. If this machine is offline, run `tfds build {name} --data_dir=DIR` on one '
        'with internet, copy DIR here and set data_dir to it') from e
  if max_examples is not None:
    dataset = dataset.take(max_examples)
  return dataset


def dataset(name: str, split: str, data_dir: str | None = None) -> Any:
  """The tf.data.Dataset of a TFDS split (slices such as 'train[0:1000]' too), in file order;
  one DataError line where it cannot be loaded."""
  return _load(name, split, data_dir, None)


def _read_string_features(dataset: Any, features: list[str], name: str) -> list[list[str]]:
  """Returns one list of decoded strings per feature, in dataset order."""
  tfds = import_tfds()

  available = sorted(dataset.element_spec) if isinstance(dataset.element_spec, dict) else []
  missing = [f for f in features if f not in available]
  if missing:
    raise DataError(f'TFDS dataset {name!r} has no feature {missing[0]!r}; it has '
                    f'{available}. Check the language codes or the feature name')
  columns: list[list[str]] = [[] for _ in features]
  for batch in tfds.as_numpy(dataset.batch(_READ_BATCH)):
    for column, feature in zip(columns, features):
      try:
        column.extend(value.decode('utf-8') for value in batch[feature])
      except UnicodeDecodeError as e:
        raise DataError(f'TFDS dataset {name!r} feature {feature!r} holds text that is not '
                        f'valid UTF-8 ({e})') from None
  return columns


def load_tfds_parallel(name: str, split: str, src_lang: str, tgt_lang: str, *,
                       data_dir: str | None = None,
                       max_examples: int | None = None) -> tuple[list[str], list[str]]:
  """Reads a TFDS translation corpus (e.g. 'wmt14_translate/de-en') as (source, target).

  Each example is a dict with one string per language, e.g. {'de': ..., 'en': ...}.
  Whitespace is stripped and pairs with an empty side are dropped, as for text files.
  """
  dataset = _load(name, split, data_dir, max_examples)
  src, tgt = _read_string_features(dataset, [src_lang, tgt_lang], name)
  src_kept, tgt_kept = [], []
  for s, t in zip(src, tgt):
    s, t = s.strip(), t.strip()
    if s and t:
      src_kept.append(s)
      tgt_kept.append(t)
  if len(src_kept) < len(src):
    logging.info('%s[%s]: dropped %d pairs with an empty side', name, split,
                 len(src) - len(src_kept))
  if not src_kept:
    raise DataError(f'TFDS dataset {name!r} split {split!r} has no {src_lang}-{tgt_lang} pair '
                    'with text on both sides')
  logging.info('read %d %s-%s pairs from TFDS %s[%s]', len(src_kept), src_lang, tgt_lang, name,
               split)
  return src_kept, tgt_kept


def load_tfds_text(name: str, split: str, *, feature: str = 'text', data_dir: str | None = None,
                   max_examples: int | None = None) -> list[str]:
  """Reads one string feature of a TFDS corpus (e.g. 'lm1b'), dropping empty texts.

  Texts are returned whole: for 'tiny_shakespeare' a split is a single long text,
  which the caller cuts into training sequences.
  """
  dataset = _load(name, split, data_dir, max_examples)
  (texts,) = _read_string_features(dataset, [feature], name)
  kept = [text for text in texts if text.strip()]
  if not kept:
    raise DataError(f'TFDS dataset {name!r} split {split!r} has no non-empty {feature!r} text')
  logging.info('read %d texts from TFDS %s[%s]', len(kept), name, split)
  return kept


class TfdsSplits(typing.Protocol):
  """What `load_tfds_train_valid` reads of a data section: the fields of the experiment's typed
  data record (workflows/*_sections.py), so the counts arrive as ints."""
  tfds_name: str
  tfds_feature: str
  tfds_data_dir: str  # '' = the TFDS default
  train_split: str
  valid_split: str
  max_train_examples: int  # 0 = all
  max_valid_examples: int  # 0 = all


def load_tfds_train_valid(data: TfdsSplits) -> tuple[list[str], list[str]]:
  """(train texts, validation texts) of the TFDS corpus a data section names."""
  kwargs = dict(feature=data.tfds_feature, data_dir=data.tfds_data_dir or None)
  train_limit, valid_limit = data.max_train_examples or None, data.max_valid_examples or None
  train = load_tfds_text(data.tfds_name, data.train_split, max_examples=train_limit, **kwargs)
  valid = load_tfds_text(data.tfds_name, data.valid_split, max_examples=valid_limit, **kwargs)
  return train, valid
