"""Typed config sections of the translation experiment (experiments/translate.py and the
workflows translation*.py, span_corruption.py and t5_init.py), read once from the
ml_collections config.

    run = translation_sections.Translation.of(config)   # data, tokenizer, eval, loss, init
    run.data.max_len, run.tokenizer.model_vocab_size     # ints, checked once; no int(config...)

One data record for both of data.task's kinds, translation (parallel text from data.source
'files', 'tfds' or 'numbers') and span corruption (plain text, T5's pretraining), unlike BERT's
one record per kind: experiments/configs/translate_common.py sets the keys of both in every
translation config, so every workdir saved them, and a span-corruption key in a translation
config (or the reverse) is a default left alone, not a mistake. A typo is still one line naming
the nearest keys.

Required fields are the keys the workflow has always read as they are (every translation config
has them); the others keep the default that the workflow gave a config written before they
existed (data.task 'translation', data.pack False, tokenizer.num_sentinels 0, no init, ...),
so a workdir's saved config reads as it meant. The records read sections only, never keys at
the top of the config beside seed and model. The workflows' functions take the ml_collections
config or its record (`Translation.of(record)` is the record), so a run reads its config once
at its entry and passes the record down; a fine-tuning run's config is rewritten once with the
pretrained model's sections (workflows/t5_init.py) and read again then.
"""

import dataclasses
import typing

from transformer_jax.data.span_corruption import MEAN_NOISE_SPAN_LENGTH, NOISE_DENSITY
from transformer_jax.errors import ConfigError
from transformer_jax.sections import Section, section_of, value_of

TRANSLATION, SPAN_CORRUPTION = 'translation', 'span_corruption'  # data.task
SOURCES = ('files', 'tfds', 'numbers')  # data.source of translation
OVERFLOWS = ('filter', 'truncate')  # data.overflow: pairs longer than data.max_len
WORKDIR, HF_DIR = 'workdir', 'hf_dir'  # Init.source's kinds


@dataclasses.dataclass(frozen=True)
class Data(Section):
  """`data.*`: the examples of either task (data.task) and their batches."""
  source: str  # SOURCES (translation)
  max_len: int  # tokens incl. EOS; longer pairs are filtered or truncated (data.overflow)
  batch_tokens: int  # padded tokens per batch (source or target side)
  buckets: tuple[int, ...]  # unpacked: () = the default lengths up to max_len
  # Translation: where the pairs are, by source.
  dir: str  # 'files': {dir}/{prefix}.{lang}[.gz]
  tfds_name: str  # 'tfds'
  tfds_data_dir: str
  src_lang: str
  tgt_lang: str
  train_prefix: str
  valid_prefix: str
  overflow: str  # OVERFLOWS
  skip_invalid_utf8: bool
  max_train_examples: int  # 0 = all (span corruption: chunks)
  pack: bool = False  # several pairs per row (data/packing.py); before packing: buckets
  task: str = TRANSLATION
  source_prefix: str = ''  # text to text: on every source sentence
  # Span corruption (T5): plain text cut into chunks with spans cut out, from text_path or
  # prepared (one of them).
  text_path: str = ''
  valid_text_path: str = ''  # '' = the last valid_fraction of text_path's lines
  valid_fraction: float = 0.05
  noise_density: float = NOISE_DENSITY
  mean_noise_span_length: float = MEAN_NOISE_SPAN_LENGTH
  prepared: str = ''  # a 'lines' corpus of `python -m experiments.prepare` (local or fsspec URL)
  valid_chunks: int = 0  # prepared: the first chunks of its 'valid' split validate; 0 = all

  def check(self):
    if self.task not in (TRANSLATION, SPAN_CORRUPTION):
      raise ConfigError(f"data.task must be '{TRANSLATION}' or '{SPAN_CORRUPTION}', got "
                        f'{self.task!r}')
    if self.task == TRANSLATION and self.source not in SOURCES:
      raise ConfigError(f"data.source must be 'files', 'tfds' or 'numbers', got {self.source!r}")
    if self.overflow not in OVERFLOWS:
      raise ConfigError(f'data.overflow must be one of {OVERFLOWS}, got {self.overflow!r}')
    if self.max_len < 1 or self.batch_tokens < 1 or self.max_train_examples < 0:
      raise ConfigError('data: need max_len >= 1, batch_tokens >= 1 and max_train_examples >= 0 '
                        f'(got {self.max_len}, {self.batch_tokens}, {self.max_train_examples})')
    if self.valid_chunks < 0:
      raise ConfigError(f'data.valid_chunks must be >= 0, got {self.valid_chunks}')

  @property
  def span_corruption(self) -> bool:
    return self.task == SPAN_CORRUPTION

  @property
  def packed(self) -> bool:
    """Several pairs per row of one length, else length buckets. Span corruption's chunks
    already fill data.max_len, so it ignores data.pack (packing would only add segment ids)."""
    return self.pack and not self.span_corruption

  @property
  def noise(self) -> dict:
    """Span corruption's noise_density and mean_noise_span_length, as data/span_corruption.py's
    functions take them."""
    return dict(noise_density=self.noise_density,
                mean_noise_span_length=self.mean_noise_span_length)


@dataclasses.dataclass(frozen=True)
class Tokenizer(Section):
  """`tokenizer.*`: SentencePiece trained on the training text (or a pretrained T5's, init.*),
  with T5's sentinel ids on top."""
  vocab_size: int
  joint: bool  # one SentencePiece model for both languages
  model_type: str
  max_sentences: int
  num_sentinels: int = 0  # sentinel i = model vocabulary size - 1 - i

  def check(self):
    if self.num_sentinels < 0:
      raise ConfigError(f'tokenizer.num_sentinels must be >= 0, got {self.num_sentinels}')

  @property
  def model_vocab_size(self) -> int:
    """The model vocabulary the config asks for: tokenizer.vocab_size plus the sentinels."""
    return self.vocab_size + self.num_sentinels


@dataclasses.dataclass(frozen=True)
class Eval(Section):
  """`eval.*`: decoding for validation BLEU and the test set, and checkpoint averaging."""
  beam_size: int
  alpha: float  # length penalty
  decode_rows: int  # sentences decoded at a time
  bleu_sentences: int  # validation sentences scored with BLEU; 0 = all
  test_prefix: str  # BLEU on this split after training; '' = none
  average_last: int  # >1: average the last k checkpoints if validation BLEU agrees

  def check(self):
    if self.beam_size < 1 or self.decode_rows < 1:
      raise ConfigError(f'eval: need beam_size >= 1 and decode_rows >= 1 (got {self.beam_size}, '
                        f'{self.decode_rows})')
    if self.bleu_sentences < 0 or self.average_last < 0:
      raise ConfigError('eval: need bleu_sentences >= 0 and average_last >= 0 (got '
                        f'{self.bleu_sentences}, {self.average_last})')


@dataclasses.dataclass(frozen=True)
class Loss(Section):
  """`loss.*`: the cross-entropy's label smoothing."""
  label_smoothing: float

  def check(self):
    if not 0 <= self.label_smoothing < 1:
      raise ConfigError(f'loss.label_smoothing must be in [0, 1), got {self.label_smoothing}')


@dataclasses.dataclass(frozen=True)
class Init(Section):
  """`init.*`: the pretrained T5 a text-to-text fine-tuning starts from (workflows/t5_init.py),
  at most one of the two; none by default (and for configs saved before init existed)."""
  workdir: str = ''  # a T5 workdir of this workflow
  hf_dir: str = ''  # a Hugging Face T5 directory

  def check(self):
    if self.workdir and self.hf_dir:
      raise ConfigError(f'init.workdir={self.workdir} and init.hf_dir={self.hf_dir} are both '
                        'set: a fine-tuning run starts from one pretrained T5; clear one of them')

  @property
  def source(self) -> tuple[str, str]:
    """(WORKDIR or HF_DIR, path) of the pretrained T5; ('', '') for none."""
    if self.workdir:
      return WORKDIR, self.workdir
    return (HF_DIR, self.hf_dir) if self.hf_dir else ('', '')

  @property
  def kind(self) -> str:
    """WORKDIR, HF_DIR or '' (training from scratch)."""
    return self.source[0]


@dataclasses.dataclass(frozen=True)
class Translation:
  """A translation config read: its data, tokenizer, eval, loss and init sections, config.model
  (checked by model_config.py where a model is built), the seed, and the config itself (for
  the Trainer, the workdir's config.json and the rewrites of workflows/t5_init.py)."""
  data: Data
  tokenizer: Tokenizer
  eval: Eval
  loss: Loss
  init: Init
  model: dict
  seed: int
  config: typing.Any = dataclasses.field(repr=False, compare=False)

  @classmethod
  def of(cls, config) -> 'Translation':
    """`config` (an ml_collections config or a dict, or a record: returned as it is) read."""
    if isinstance(config, cls):
      return config
    return cls(data=Data.of(_section(config, 'data'),
                            'data'), tokenizer=Tokenizer.of(_section(config, 'tokenizer'),
                                                            'tokenizer'),
               eval=Eval.of(_section(config, 'eval'),
                            'eval'), loss=Loss.of(_section(config, 'loss'),
                                                  'loss'), init=section_of(config, 'init', Init),
               model=dict(config['model']) if 'model' in config else {},
               seed=value_of(config, 'seed', int, 0), config=config)


def _section(config, name: str):
  if name not in config:
    raise ConfigError(f'config has no section {name!r}')
  return config[name]
