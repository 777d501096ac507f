"""BERT experiments from a config: pretraining (MLM + NSP/SOP) and fine-tuning (classification).

`experiments/bert.py` and `benchmarks/{bert_pretrain,sst2_minilm}.py` are thin callers. The
work is done by one module per concept, whose public names this one re-exports for them:
  bert_sections.py     the typed config sections (data, tokenizer, init), read once per run;
  bert_pretraining.py  pretraining (config.mode='pretrain'): documents, tokenizer, batches;
  bert_continue.py     continued pretraining of a Hugging Face encoder (a pretraining config's
                       init.hf_dir): its model, tokenizer and params at step 0;
  bert_init.py         the pretrained model fine-tuning starts from (init.hf_dir: an encoder
                       family of convert/families.py, or init.bert_workdir: a pretraining
                       workdir of ours) and the tokenizer its workdir keeps;
  bert_finetuning.py   sentence (pair) classification (config.mode='finetune').
Token classification (data.task='token_classification') is workflows/token_classification.py;
using a trained workdir (predict, evaluate, fill_mask) is workflows/bert_use.py.
"""

from transformer_jax.errors import ConfigError
from transformer_jax.workflows import bert_sections
from transformer_jax.workflows.bert_finetuning import (abstract_finetune, finetune, is_pair_task,
                                                       load_classification_data, validate_finetune)
from transformer_jax.workflows.bert_init import (finetune_tokenizer, hf_family, init_model_config,
                                                 load_init, overlay_params, save_tokenizer)
from transformer_jax.workflows.bert_pretraining import (
    TOKENIZER_DIR, VOCAB_FILE, abstract_pretrain, build_pretrain, load_documents,
    model_sentence_task, pretrain, pretrain_model_config, pretrain_tokenizer, restore_pretrained,
    segment_types, tokenizer_type, validate_pretrain)
from transformer_jax.workflows.bert_sections import MODES, TOKENIZER_TYPES, TRAIN_MODES

__all__ = [
    'MODES', 'TOKENIZER_DIR', 'TOKENIZER_TYPES', 'TRAIN_MODES', 'VOCAB_FILE', 'abstract_task',
    'build_pretrain', 'finetune', 'finetune_tokenizer', 'hf_family', 'init_model_config',
    'is_pair_task', 'load_classification_data', 'load_documents', 'load_init',
    'model_sentence_task', 'overlay_params', 'pretrain', 'pretrain_model_config',
    'pretrain_tokenizer', 'restore_pretrained', 'run', 'save_tokenizer', 'segment_types',
    'tokenizer_type', 'train_mode', 'validate_finetune', 'validate_pretrain'
]


def train_mode(config, mode: str = '') -> str:
  """The training mode: `mode` (--mode) if given, else config.mode; one of TRAIN_MODES."""
  mode = mode or bert_sections.mode_of(config) or ''
  if mode not in TRAIN_MODES:
    raise ConfigError(f'mode must be one of {TRAIN_MODES} (--mode or config.mode), got {mode!r}')
  return mode


def run(config, workdir: str, mode: str = '') -> dict:
  """Pretrains, or fine-tunes on sentence classification, per `mode` or config.mode.

  A tagging config (data.task='token_classification') is refused: workflows/
  token_classification.py fine-tunes it with these modules' functions, so they cannot call it;
  experiments/bert.py, above both, picks between them.
  """
  if train_mode(config, mode) == 'pretrain':
    return pretrain(config, workdir)
  return finetune(config, workdir)


def abstract_task(config, num_devices: int | None = None):
  """(task, {key: jax.ShapeDtypeStruct}) of one global training batch, from the config alone.

  Pretraining: the model has tokenizer.vocab_size entries (no vocabulary is read or trained).
  Fine-tuning: the model is the one init.hf_dir's config.json (or init.bert_workdir's saved
  config and vocab.txt) describes, with config.model's overrides; no weights are read. Batches
  are data.batch_size rows of data.max_len tokens (the longest bucket). For the planner
  (`transformer_jax/planning/`); `num_devices` is unused, taken for the same signature as the
  other workflows.
  """
  del num_devices
  mode = bert_sections.mode_of(config) or ''
  if mode not in TRAIN_MODES:
    raise ConfigError(f'mode must be one of {TRAIN_MODES} (config.mode), got {mode!r}')
  return abstract_pretrain(config) if mode == 'pretrain' else abstract_finetune(config)
