"""The language-model experiment's typed config sections (experiments/configs/lm_common.py).

    sections = LmSections.of(config)       # read and checked once, by workflows/lm.py's entries
    sections.data.block_size               # an int; no int(config.data...) further down
    sections.model_config(vocab_size)      # config.model sized to the tokenizer

`data`, `tokenizer`, `eval` (the samples written at every evaluation) and `init` (the Hugging
Face model a run continues pretraining from: workflows/lm_init.py) are `Section` records
(transformer_jax/sections.py: unknown keys, types and ranges are one ConfigError line); the
model section is `TransformerConfig`'s (model_config.py), built here with the vocabulary the
config asks for and data.block_size as its context, so a wrong width or head count fails before
a tokenizer is trained. An imported model's section (the one lm_init.py writes) names its own
vocab_size (the embedding's rows) and max_len (its position table), which then stay as they are:
windows of data.block_size tokens fit in that context. Keys added after workdirs were first
written (data.pack, init) have defaults: an old workdir's config.json reads as it did.
"""

import dataclasses

from transformer_jax.errors import ConfigError
from transformer_jax.model_config import TransformerConfig, model_config_from_dict
from transformer_jax.sections import RunSections, Section, section_of

DATA_SOURCES = ('file', 'tfds', 'prepared')
# 'hf': a Hugging Face tokenizer folder taken as it is (an imported model's, or a prepared
# corpus's), never trained here.
TOKENIZER_TYPES = ('char', 'sentencepiece', 'byte_bpe', 'hf')


@dataclasses.dataclass(frozen=True)
class Data(Section):
  """`data.*`: where the text comes from and how it is cut into windows."""
  source: str
  block_size: int  # tokens per window: the model's context (max_len)
  batch_size: int  # windows per global batch
  path: str = ''  # 'file': one UTF-8 text file
  train_fraction: float = 0.9  # 'file': the first part trains, the rest validates
  tfds_name: str = ''  # 'tfds': e.g. 'tiny_shakespeare' or 'lm1b'
  tfds_feature: str = 'text'
  tfds_data_dir: str = ''
  train_split: str = 'train'
  valid_split: str = 'validation'
  max_train_examples: int = 0  # 'tfds': 0 = all documents
  max_valid_examples: int = 0
  eval_batches: int = 20  # fixed validation batches, the same at every evaluation
  pack: bool = False  # documents as attention segments (needs a subword tokenizer)
  prepared: str = ''  # 'prepared': a folder of `python -m experiments.prepare` (local or gs://)

  def check(self):
    if self.source not in DATA_SOURCES:
      raise ConfigError(f"data.source must be 'file', 'tfds' or 'prepared', got {self.source!r}")
    if self.source == 'prepared' and not self.prepared:
      raise ConfigError("data.source='prepared' reads a prepared corpus: pass "
                        '--config.data.prepared=DIR (python -m experiments.prepare makes one)')
    for key in ('block_size', 'batch_size'):
      if getattr(self, key) < 1:
        raise ConfigError(f'data.{key} must be positive, got {getattr(self, key)}')
    if min(self.eval_batches, self.max_train_examples, self.max_valid_examples) < 0:
      raise ConfigError('data.eval_batches, data.max_train_examples and data.max_valid_examples '
                        f'must be >= 0, got {self.eval_batches}, {self.max_train_examples} and '
                        f'{self.max_valid_examples}')


@dataclasses.dataclass(frozen=True)
class Tokenizer(Section):
  """`tokenizer.*`: characters, a SentencePiece model, GPT-2's byte-level BPE or a Hugging Face
  tokenizer folder ('hf')."""
  type: str = 'char'
  vocab_size: int = 256  # 'sentencepiece' and 'byte_bpe'; a char vocabulary sizes itself
  model_type: str = 'unigram'  # 'sentencepiece'
  max_sentences: int = 2_000_000  # 'sentencepiece'

  def check(self):
    if self.type not in TOKENIZER_TYPES:
      raise ConfigError("tokenizer.type must be 'char', 'sentencepiece', 'byte_bpe' or 'hf', got "
                        f'{self.type!r}')
    if self.vocab_size < 1:
      raise ConfigError(f'tokenizer.vocab_size must be positive, got {self.vocab_size}')


@dataclasses.dataclass(frozen=True)
class Sampling(Section):
  """`eval.*`: the sample written at every evaluation (a fixed prompt and seed, so steps
  compare); sample_tokens=0 writes none."""
  sample_prompt: str = '\n'
  sample_tokens: int = 200
  temperature: float = 0.8
  top_k: int = 200
  top_p: float = 1.0

  def check(self):
    if (self.sample_tokens < 0 or self.temperature < 0 or self.top_k < 0 or
        not 0.0 < self.top_p <= 1.0):
      raise ConfigError('eval: need sample_tokens >= 0, temperature >= 0, top_k >= 0 and '
                        f'0 < top_p <= 1 (got {self.sample_tokens}, {self.temperature}, '
                        f'{self.top_k}, {self.top_p})')


@dataclasses.dataclass(frozen=True)
class Init(Section):
  """`init.*`: the Hugging Face causal LM a run continues pretraining from (its model, weights and
  tokenizer: workflows/lm_init.py); '' (the default, and configs saved before init existed)
  trains from scratch."""
  hf_dir: str = ''


@dataclasses.dataclass(frozen=True)
class LmSections:
  """Every section of a language-model config, typed: what the LM workflow reads."""
  run: RunSections
  data: Data
  tokenizer: Tokenizer
  eval: Sampling
  init: Init
  # config.model with tokenizer.vocab_size entries and data.block_size positions, unless the
  # section names its own (an imported model's)
  model: TransformerConfig
  # Whether config.model names its own vocab_size (an imported model's embedding, whose rows
  # may exceed the tokenizer's ids), which then sizes the model whatever the tokenizer.
  own_vocab_size: bool = False

  @classmethod
  def of(cls, config) -> 'LmSections':
    data = section_of(config, 'data', Data)
    tokenizer = section_of(config, 'tokenizer', Tokenizer)
    if data.pack and tokenizer.type == 'char':
      # Segment boundaries are the EOS ids between documents: only a subword stream has them.
      raise ConfigError("data.pack=True needs documents (a subword tokenizer whose documents "
                        "are joined with EOS: tokenizer.type='sentencepiece' or 'byte_bpe'); "
                        "tokenizer.type='char' reads one character stream without them")
    init = section_of(config, 'init', Init)
    if tokenizer.type == 'hf' and not init.hf_dir and data.source != 'prepared':
      raise ConfigError("tokenizer.type='hf' is a Hugging Face tokenizer taken as it is, never "
                        'trained here: set --config.init.hf_dir=DIR (its model and tokenizer) or '
                        "read a corpus prepared with one (data.source='prepared')")
    section = dict(config.model)
    sizes = {
        k: v
        for k, v in (('vocab_size', tokenizer.vocab_size), ('max_len', data.block_size))
        if k not in section
    }
    model = model_config_from_dict(section, num_encoder_layers=0, **sizes)
    if data.block_size > model.max_len:
      raise ConfigError(f'data.block_size={data.block_size} is longer than the model\'s context '
                        f'(model.max_len={model.max_len}); set --config.data.block_size='
                        f'{model.max_len} or less')
    return cls(run=RunSections.of(config), data=data, tokenizer=tokenizer,
               eval=section_of(config, 'eval', Sampling), init=init, model=model,
               own_vocab_size='vocab_size' in section)

  def model_config(self, vocab_size: int) -> TransformerConfig:
    """The model for a tokenizer of `vocab_size` tokens (an imported model keeps its rows)."""
    return self.model if self.own_vocab_size else self.model.replace(vocab_size=vocab_size)
