"""Typed config sections of the BERT-family experiments (experiments/bert.py and the workflows
bert*.py and token_classification.py), read once from the ml_collections config.

    run = bert_sections.Pretraining.of(config)    # data, tokenizer, model; checked once
    run.data.max_len, run.tokenizer.type          # an int and a str; no int(config...) later

The data section's keys depend on what is trained, so there is one data record per kind:
  PretrainData        mode 'pretrain' (experiments/configs/bert_common.py `pretrain_config`);
  ClassificationData  mode 'finetune': sentences or sentence pairs (`finetune_config`; a pair
                      is two data.text_columns or a GLUE pair task, not other keys);
  TaggingData         mode 'finetune' with data.task='token_classification' (conll_tagging.py).
One record per kind rather than one with every key of the experiment: the kinds share only
source, max_len, batch_size and pack, so a union record would take data.paths in a fine-tuning
config or data.num_labels in a pretraining one without a word, and its nearest-key hints would
name keys the run never reads. Per kind, a key of another kind is refused with the keys of the
kind being run.

Around the data record: `Pretraining` (data, tokenizer, init) and `FineTuning` (data, init),
each an `Experiment` that also holds config.model, the seed and the config it was read from
(`.config`, for what takes the whole config: the Trainer and the workdir's config.json). Required
fields are the keys every config of the kind has; the others default to what configs written
before them meant (data.pack False, data.type_vocab_size 2, tokenizer.type 'wordpiece', no
init, ...), so a workdir's saved config reads as it was written. The BERT configs have no eval
section. The workflows' functions take the ml_collections config or its record
(`Pretraining.of(record)` is the record), so a run reads its config once at its entry and passes
the record down.
"""

import abc
import dataclasses
import typing

from transformer_jax.data.bert_pretrain import PAIR_TASKS, SENTENCE_TASKS
from transformer_jax.errors import ConfigError
from transformer_jax.sections import Section, section_of, value_of

# 'sentencepiece': ALBERT's unigram tokenizer.json, never trained here: an imported ALBERT's
# (init.hf_dir), which continued pretraining copies into WORKDIR/tokenizer/.
TOKENIZER_TYPES = ('wordpiece', 'byte_bpe', 'sentencepiece')
TRAIN_MODES = ('pretrain', 'finetune')
MODES = TRAIN_MODES + ('predict', 'evaluate', 'fill_mask')
TAGGING_TASK = 'token_classification'  # data.task of a tagging config
DATA_TASKS = ('', TAGGING_TASK)  # '' (or no data.task) = sentence (pair) classification


def mode_of(config) -> str | None:
  """config.mode ('pretrain', 'finetune', ...), or None when the config has none (not a BERT
  experiment's: a language model's or a translation's)."""
  return value_of(config, 'mode', str, None)


def _refuse_packed_finetuning(pack: bool):
  if pack:
    raise ConfigError('data.pack=True is for pretraining only: fine-tuning is not packed (the '
                      'classifier reads one [CLS] per row, one example per row); set '
                      'data.pack=False')


@dataclasses.dataclass(frozen=True)
class Tokenizer(Section):
  """`tokenizer.*` of pretraining: WordPiece (vocab_file, or trained into WORKDIR/vocab.txt),
  RoBERTa's byte-level BPE (trained into WORKDIR/tokenizer/), or, continuing an import, its
  tokenizer as one of those or ALBERT's SentencePiece (WORKDIR/tokenizer/)."""
  vocab_size: int
  type: str = 'wordpiece'
  vocab_file: str = ''  # wordpiece: a BERT vocab.txt; '' = train on the corpus
  lowercase: bool = True  # wordpiece only

  def check(self):
    if self.type not in TOKENIZER_TYPES:
      raise ConfigError(f'tokenizer.type must be one of {TOKENIZER_TYPES}, got {self.type!r}')


@dataclasses.dataclass(frozen=True)
class Rows(Section):
  """The data keys of every kind: where the examples come from (each kind has its sources)
  and the rows of a global batch."""
  source: str
  max_len: int  # tokens per row, [CLS] and [SEP]s included
  batch_size: int


PRETRAIN_SOURCES = ('files', 'tfds', 'prepared')


@dataclasses.dataclass(frozen=True)
class PretrainData(Rows):
  """`data.*` of pretraining: local text files (source 'files'), a TFDS corpus ('tfds'), or a
  corpus tokenized once into shards by `python -m experiments.prepare --unit=lines` ('prepared':
  the folder data.prepared, local or an fsspec URL), cut into MLM (+ NSP/SOP) rows
  (data/bert_pretrain.py)."""
  max_predictions: int
  mask_rate: float
  sentence_task: str  # data/bert_pretrain.SENTENCE_TASKS
  eval_batches: int
  paths: str = ''  # 'files': comma-separated
  lines_per_document: int = 0
  valid_fraction: float = 0.02
  tfds_name: str = ''
  tfds_feature: str = 'text'
  tfds_data_dir: str = ''
  train_split: str = 'train'
  valid_split: str = 'validation'
  max_train_examples: int = 0
  max_valid_examples: int = 0
  type_vocab_size: int = 2  # segment ids of the model (RoBERTa's 1)
  short_seq_prob: float = 0.1
  pack: bool = False
  prepared: str = ''  # 'prepared': the corpus folder (configs written before it have none)

  def check(self):
    if self.source not in PRETRAIN_SOURCES:
      # Worded as before 'prepared' came, which tests and users may match.
      raise ConfigError(f"data.source must be 'files' or 'tfds', got {self.source!r} (or "
                        "'prepared': a corpus of python -m experiments.prepare, in data.prepared)")
    if self.source == 'prepared' and not self.prepared:
      raise ConfigError("data.source='prepared' reads a corpus of python -m experiments.prepare "
                        '--unit=lines: pass --config.data.prepared=DIR')
    if self.prepared and self.source != 'prepared':
      raise ConfigError(f'data.prepared={self.prepared!r} is read only with '
                        f"data.source='prepared', not {self.source!r}: set "
                        '--config.data.source=prepared, or data.prepared=\'\'')
    task = self.sentence_task
    if task not in SENTENCE_TASKS:
      raise ConfigError(f'data.sentence_task must be one of {SENTENCE_TASKS}, got {task!r}')
    if self.pack and task in PAIR_TASKS:
      raise ConfigError(f'data.pack=True cannot pack data.sentence_task={task!r}: its sentence '
                        "head reads one [CLS] per row; use sentence_task 'none' or "
                        "'full_sentences', or data.pack=False")
    if self.type_vocab_size < 1:
      raise ConfigError(f'data.type_vocab_size must be at least 1, got {self.type_vocab_size}')


@dataclasses.dataclass(frozen=True)
class ClassificationData(Rows):
  """`data.*` of sentence (pair) classification: GLUE-style TSVs (source 'tsv') or a TFDS GLUE
  task ('tfds'; data/classification.py)."""
  num_labels: int
  dir: str = ''  # 'tsv': DIR/train_file and DIR/dev_file
  tfds_name: str = 'glue/sst2'
  tfds_data_dir: str = ''
  max_train_examples: int = 0  # 0 = all
  pack: bool = False  # refused: one [CLS] per row
  # () = the one column named sentence/content/text; two = a sentence pair. Header names or
  # 0-based positions.
  text_columns: tuple[int | str, ...] = ()
  label_column: str = ''  # '' = the column named 'label'
  label_names: tuple[str, ...] = ()  # index = label id; () = '0', '1', ...
  train_file: str = 'train.tsv'
  dev_file: str = 'dev.tsv'
  test: str = ''  # --mode=evaluate: a labelled TSV
  task: str = ''  # DATA_TASKS: '' here

  def check(self):
    _refuse_packed_finetuning(self.pack)
    if self.source not in ('tsv', 'tfds'):
      raise ConfigError(f"data.source must be 'tsv' or 'tfds', got {self.source!r}")
    if len(self.text_columns) > 2:
      raise ConfigError(f'data.text_columns={self.text_columns}: one or two columns (a sentence '
                        f'pair), not {len(self.text_columns)}')

  def class_names(self) -> tuple[str, ...]:
    """data.label_names, else '0', '1', ...: one name per class (data.num_labels), else one
    ConfigError line. Checked where classes are named (a run's validation, predict, evaluate),
    not on reading: loading a split's labels needs no names."""
    if self.label_names and len(self.label_names) != self.num_labels:
      raise ConfigError(f'data.label_names has {len(self.label_names)} names but '
                        f'data.num_labels={self.num_labels}')
    return self.label_names or tuple(str(i) for i in range(self.num_labels))


@dataclasses.dataclass(frozen=True)
class TaggingData(Rows):
  """`data.*` of token classification: CoNLL-style files (source 'conll'; data/conll.py)."""
  task: str  # TAGGING_TASK
  train: str
  dev: str
  pack: bool = False  # refused: one sentence per row
  test: str = ''

  def check(self):
    _refuse_packed_finetuning(self.pack)


@dataclasses.dataclass(frozen=True)
class PretrainInit(Section):
  """`init.*` of pretraining: a Hugging Face encoder to continue pretraining
  (workflows/bert_continue.py); '' (and configs written before it) trains from scratch."""
  hf_dir: str = ''


@dataclasses.dataclass(frozen=True)
class Init(Section):
  """`init.*`: the pretrained model fine-tuning starts from (one of the two is set)."""
  hf_dir: str  # a Hugging Face encoder directory (convert/families.py)
  bert_workdir: str  # or a pretraining workdir of ours


@dataclasses.dataclass(frozen=True)
class Experiment(abc.ABC):
  """What a BERT config of any kind holds beside its own sections: config.model (the model to
  build, or overrides of the pretrained one's config; model_config.py names unknown keys), the
  seed, and the config itself (for the Trainer and the workdir's config.json)."""
  model: dict
  seed: int
  config: typing.Any = dataclasses.field(repr=False, compare=False)

  @classmethod
  def of(cls, config):
    """`config` (an ml_collections config, or a record of this kind: returned as it is) read."""
    if isinstance(config, cls):
      return config
    model = dict(config['model']) if 'model' in config else {}
    return cls(model=model, seed=value_of(config, 'seed', int, 0), config=config,
               **cls.sections(config))

  @classmethod
  @abc.abstractmethod
  def sections(cls, config) -> dict:
    """This kind's records read from `config`, by field name (Pretraining's, FineTuning's)."""


@dataclasses.dataclass(frozen=True)
class Pretraining(Experiment):
  """A pretraining config: data, tokenizer and init; config.model is the model to build (once
  workflows/bert_continue.py rewrote a config with init.hf_dir, the imported one)."""
  data: PretrainData
  tokenizer: Tokenizer
  init: PretrainInit

  @classmethod
  def sections(cls, config) -> dict:
    data = PretrainData.of(_section(config, 'data'), 'data')
    tokenizer = Tokenizer.of(_section(config, 'tokenizer'), 'tokenizer')
    init = section_of(config, 'init', PretrainInit)
    # WordPiece and ALBERT pairs give segment B the id 1; RoBERTa's gives every token segment 0.
    task, types = data.sentence_task, data.type_vocab_size
    if task in PAIR_TASKS and types < 2 and tokenizer.type != 'byte_bpe':
      name = 'WordPiece' if tokenizer.type == 'wordpiece' else 'SentencePiece'
      raise ConfigError(f"data.sentence_task={task!r} with {name} gives sentence B segment "
                        f'id 1: data.type_vocab_size must be 2, got {types}')
    if data.source == 'prepared' and tokenizer.vocab_file:
      raise ConfigError(f'tokenizer.vocab_file={tokenizer.vocab_file!r} is not read with '
                        "data.source='prepared': the corpus's ids come from its own tokenizer "
                        "(prepare it with --tokenizer_from=VOCAB); set tokenizer.vocab_file=''")
    if init.hf_dir and data.source == 'prepared':
      raise ConfigError(f'init.hf_dir={init.hf_dir} brings its own tokenizer, but '
                        f'data.prepared={data.prepared} holds ids of another: continue pretraining '
                        "from text (data.source 'files' or 'tfds')")
    if init.hf_dir and tokenizer.vocab_file:
      raise ConfigError(f'tokenizer.vocab_file={tokenizer.vocab_file!r} is not read with '
                        f'init.hf_dir={init.hf_dir}: the imported model\'s tokenizer is the '
                        "run's; set tokenizer.vocab_file=''")
    if tokenizer.type == 'sentencepiece' and not init.hf_dir:
      raise ConfigError("tokenizer.type='sentencepiece' is ALBERT's tokenizer of an import, never "
                        "trained here: set init.hf_dir to an ALBERT folder, or tokenizer.type "
                        "'wordpiece'")
    return {'data': data, 'tokenizer': tokenizer, 'init': init}


@dataclasses.dataclass(frozen=True)
class FineTuning(Experiment):
  """A fine-tuning config: its data (ClassificationData or TaggingData, per data.task) and the
  starting model (init); config.model holds overrides of that model's config."""
  data: ClassificationData | TaggingData
  init: Init

  @classmethod
  def sections(cls, config) -> dict:
    node = _section(config, 'data')
    task = value_of(node, 'task', str, '', 'data.task')
    if task not in DATA_TASKS:
      raise ConfigError(f'data.task must be one of {DATA_TASKS} (\'\' = sentence '
                        f'classification), got {task!r}')
    record = TaggingData if task == TAGGING_TASK else ClassificationData
    return {'data': record.of(node, 'data'), 'init': Init.of(_section(config, 'init'), 'init')}

  @property
  def tagging(self) -> bool:
    return isinstance(self.data, TaggingData)


def _section(config, name: str):
  if name not in config:
    raise ConfigError(f'config has no section {name!r}')
  return config[name]
