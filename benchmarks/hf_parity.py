r"""Parity with Hugging Face transformers, family by family: import, generation, export, round trip.

  python benchmarks/hf_parity.py                           # every family (~30 s on 2 cores)
  python benchmarks/hf_parity.py --families=gpt2,t5_v1_1 --seed=3
  python benchmarks/hf_parity.py --families=gpt2 --quick   # smaller batch, 8 new tokens

For each family a small random float32 model is built with transformers (width 64, 2 layers, as
in tests/test_hf_*_parity.py), its weights perturbed away from HF's init as those tests do (an
init's unit norms and zero biases would hide a mis-mapped norm or bias; GPT-2 by N(0, 0.2^2), not
0.05, so that its greedy continuations vary), and saved with `save_pretrained` to a temporary
directory. Then:

  import     max |our logits - HF's| after `families.named(family).load(d)` on a fixed batch.
             T5: teacher-forced, source rows padded (HF gets the attention mask, ours masks PAD
             ids). BERT: the MLM logits at every real (non-pad) position of a
             `BertForPreTraining`, and its NSP logits (`import_sentence_max_abs_diff`).
  greedy     causal LMs and T5: greedy continuations of `new_tokens` ids, ours (KV-cache
             decoding: `LanguageModelTask.generate`, `TranslationTask.predict_tokens`) against
             HF's `generate`; the fraction of identical ids. Causal LMs run without EOS, so
             every id counts; T5 stops at EOS and pads after it, as both sides do.
  export     `<family>_config_to_hf` + `export_<family>_state_dict` written with
             `convert.export.write_hf_directory`, reloaded with transformers' Auto class
             (missing / unexpected keys reported), max |our logits - the reloaded model's|.
  round trip whether importing the exported directory gives our params back bit for bit (and
             the same config).
  scale      max |logit| of the HF model on the import batch: what the differences compare to.

Families: gpt2 (tied head, gelu_new), llama (grouped-query attention 4:2, rope_theta 500, untied
head), t5_v1_0 (ReLU, tied output rescaled by d_model**-0.5), t5_v1_1 (gated GELU, untied
lm_head), bert (BertForPreTraining: MLM + NSP); albert (AlbertForPreTraining: embedding 32
projected to 64, one layer shared by 2, MLM + SOP) and roberta (RobertaForMaskedLM: <pad> 1,
positions past it, one token type, a byte-level vocabulary) when their converters
(transformer_jax/convert/hf_albert.py, hf_roberta.py) are present.

Progress and one readable line per family go to stderr; the last stdout line is one JSON
object: date, commit (+dirty), CPU model (lscpu), library versions and every figure. An unknown
--families name is one error line and exit status 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datetime
import functools
import json
import shutil
import tempfile
import time
from typing import Callable

import numpy as np
from absl import app, flags

from tools import machine
from transformer_jax.errors import ConfigError, UserError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The order of a full run; optional families join only where their converter module exists.
FAMILIES = ('gpt2', 'llama', 'opt', 't5_v1_0', 't5_v1_1', 'bert')
OPTIONAL_FAMILIES = {'albert': 'hf_albert', 'roberta': 'hf_roberta'}
# What the parity tests accept in float32 (tests/test_hf_*_parity.py).
TOLERANCE = 1e-4

_FAMILIES = flags.DEFINE_list(
    'families', None, f'Families to run, of {list(FAMILIES) + list(OPTIONAL_FAMILIES)} '
    '(default: all whose converters are present).')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the random HF models and the token batches.')
_QUICK = flags.DEFINE_bool('quick', False, 'Smaller batches and 8 new tokens (a smoke test).')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 32, 'Greedy tokens per row (--quick: 8).')
_PRECISION = flags.DEFINE_enum(
    'matmul_precision', 'highest', ['default', 'high', 'highest'],
    "JAX matmul precision ('highest': float32 products on accelerators too; CPU is exact "
    'float32 at any setting).')


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


# -- the machine and the tree -------------------------------------------------------------------

# -- shared pieces ------------------------------------------------------------------------------


def perturb(model, seed: int, scale: float = 0.05):
  """Adds N(0, scale^2) to every parameter (tests/test_hf_{gpt2,llama,bert}_parity.py)."""
  import torch
  torch.manual_seed(seed + 1)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(scale * torch.randn_like(p))
  return model.eval()


def save(model, root: str, name: str) -> str:
  directory = os.path.join(root, name)
  model.save_pretrained(directory)
  return directory


def max_abs(a, b, where=None) -> float:
  diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
  return float((diff[where] if where is not None else diff).max())


def bitwise_equal(a: dict, b: dict) -> bool:
  """Same leaves (paths, dtypes, shapes, bytes): import(export(params)) == params."""
  import flax
  import jax
  flat = lambda tree: flax.traverse_util.flatten_dict(jax.device_get(tree), sep='/')
  a, b = flat(a), flat(b)
  if a.keys() != b.keys():
    return False
  for key, x in a.items():
    x, y = np.asarray(x), np.asarray(b[key])
    if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
      return False
  return True


def export_and_reload(root: str, name: str, hf_config: dict, state: dict, auto_class):
  """(directory, reloaded HF model, loading info) of our export through write_hf_directory."""
  from transformer_jax.convert.export import write_hf_directory
  directory = write_hf_directory(os.path.join(root, name), hf_config, state, None)
  model, info = auto_class.from_pretrained(directory, output_loading_info=True)
  return directory, model.eval(), info


def loading_figures(info) -> dict:
  return {
      'export_missing_keys': sorted(info.get('missing_keys', [])),
      'export_unexpected_keys': sorted(info.get('unexpected_keys', []))
  }


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict:
  same = int((np.asarray(ours) == np.asarray(theirs)).sum())
  return {
      'greedy_identical': same, 'greedy_total': int(np.size(ours)),
      'greedy_agreement': same / max(1, int(np.size(ours)))
  }


# -- causal LMs: GPT-2, LLaMA --------------------------------------------------------------------


def _causal_lm(family: str, hf_model, to_hf: Callable, export_state: Callable, root: str, seed: int,
               quick: bool, new_tokens: int) -> dict:
  """Import (`families.named(family).load`), greedy generation, export and round trip of a
  `GPT`-architecture family."""
  import jax
  import jax.numpy as jnp
  import torch
  import transformers
  from transformer_jax.convert import families
  from transformer_jax.models.gpt import GPT
  from transformer_jax.tasks.lm import LanguageModelTask
  directory = save(hf_model, root, family)
  imported = families.named(family).load(directory)
  cfg, params = imported.config, imported.params
  vocab = cfg.vocab_size
  rng = np.random.default_rng(seed)
  batch, length = (2, 16) if quick else (3, 40)
  tokens = rng.integers(0, vocab, (batch, length), dtype=np.int32)
  apply = jax.jit(GPT(cfg).apply)
  ours = np.asarray(apply({'params': params}, jnp.asarray(tokens)))

  def hf_logits(model):
    with torch.no_grad():
      return model(torch.from_numpy(tokens).long()).logits.numpy()

  theirs = hf_logits(hf_model)
  figures = {'import_max_abs_diff': max_abs(ours, theirs)}

  prompt = rng.integers(0, vocab, (2, 8), dtype=np.int32)
  generated = LanguageModelTask(cfg).generate(params, prompt, new_tokens, jax.random.key(0),
                                              temperature=0.0)
  hf_model.generation_config.eos_token_id = None  # both run the full new_tokens
  with torch.no_grad():
    hf_generated = hf_model.generate(
        torch.from_numpy(prompt).long(), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
        do_sample=False, max_new_tokens=new_tokens, pad_token_id=0).numpy()[:, prompt.shape[1]:]
  figures.update(agreement(generated, hf_generated))
  figures['greedy_distinct_ids'] = len(set(np.asarray(generated).ravel().tolist()))

  out, reloaded, info = export_and_reload(root, f'{family}_exported', to_hf(cfg),
                                          export_state(cfg, params),
                                          transformers.AutoModelForCausalLM)
  figures['export_class'] = type(reloaded).__name__
  figures['export_max_abs_diff'] = max_abs(ours, hf_logits(reloaded))
  figures.update(loading_figures(info))
  again = families.named(family).load(out)
  figures['round_trip_bitwise'] = bitwise_equal(again.params, params)
  figures['round_trip_config_equal'] = again.config == cfg
  figures['max_abs_logit'] = float(np.abs(theirs).max())
  figures['shapes'] = {'logits': list(ours.shape), 'prompt': list(prompt.shape)}
  return figures


def run_gpt2(root: str, seed: int, quick: bool, new_tokens: int) -> dict:
  import torch
  import transformers
  from transformer_jax.convert import hf_gpt2
  torch.manual_seed(seed)
  config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=101,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   activation_function='gelu_new', layer_norm_epsilon=1e-5,
                                   bos_token_id=100, eos_token_id=100)
  # 0.2, not the tests' 0.05: at 0.05 greedy GPT-2 repeats one or two ids (1 distinct id in 64
  # at seed 0), which would make the generation agreement say nothing.
  model = perturb(transformers.GPT2LMHeadModel(config), seed, scale=0.2)
  return _causal_lm('gpt2', model, hf_gpt2.gpt2_config_to_hf, hf_gpt2.export_gpt2_state_dict, root,
                    seed, quick, new_tokens)


def run_llama(root: str, seed: int, quick: bool, new_tokens: int) -> dict:
  import torch
  import transformers
  from transformer_jax.convert import hf_llama
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96, vocab_size=256,
                                    max_position_embeddings=128, rope_theta=500.0,
                                    rms_norm_eps=1e-3, bos_token_id=1, eos_token_id=2,
                                    tie_word_embeddings=False)
  model = perturb(transformers.LlamaForCausalLM(config), seed)
  to_hf = functools.partial(hf_llama.llama_config_to_hf, bos_token_id=1, eos_token_id=2)
  return _causal_lm('llama', model, to_hf, hf_llama.export_llama_state_dict, root, seed, quick,
                    new_tokens)


def run_opt(root: str, seed: int, quick: bool, new_tokens: int) -> dict:
  """OPT, read and written through the registry (convert/families.py) as a new family is."""
  import torch
  import transformers
  from transformer_jax.convert import families
  torch.manual_seed(seed)
  config = transformers.OPTConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                  num_attention_heads=4, max_position_embeddings=128, dropout=0.0,
                                  attention_dropout=0.0, activation_function='relu', bos_token_id=2,
                                  eos_token_id=2, pad_token_id=1)
  model = perturb(transformers.OPTForCausalLM(config), seed, scale=0.2)
  family = families.named('opt')
  to_hf, export_state = family.exporters(
      special_ids={'bos_token_id': 2, 'eos_token_id': 2, 'pad_token_id': 1})
  return _causal_lm('opt', model, to_hf, export_state, root, seed, quick, new_tokens)


# -- T5 -------------------------------------------------------------------------------------------

T5_VOCAB = 200
T5_SMALL = dict(vocab_size=T5_VOCAB, d_model=64, d_kv=16, num_heads=4, d_ff=96, num_layers=2,
                num_decoder_layers=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                eos_token_id=1)
T5_VERSIONS = {
    '1.0': dict(feed_forward_proj='relu'),
    '1.1': dict(feed_forward_proj='gated-gelu', tie_word_embeddings=False),
}


def _t5_model(version: str, seed: int):
  """A random T5ForConditionalGeneration at the scales of tests/test_hf_t5_parity.py (there: why
  these scales), v1.1 with an lm_head.weight of its own."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(
      transformers.T5Config(**T5_SMALL, **T5_VERSIONS[version]))
  if version == '1.1':
    model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'relative_attention_bias' in name:
        p.normal_(0.0, 1.0)
      elif name in ('shared.weight', 'lm_head.weight'):
        p.normal_(0.0, 0.3)
      elif p.ndim == 2:  # linear layers [out, in]: gain 2, queries 0.5
        gain = 0.5 if name.endswith('.q.weight') else 2.0
        p.normal_(0.0, gain / p.shape[1]**0.5)
      else:  # norms
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def _t5_sources(rng, rows: int, length: int):
  """Sources [rows, length], rows after the first padded (each ends in EOS, as T5's do)."""
  inputs = rng.integers(2, T5_VOCAB, (rows, length)).astype(np.int32)
  lengths = np.maximum(2, np.array([length, length * 7 // 12, length // 4] * rows)[:rows])
  valid = np.arange(length)[None] < lengths[:, None]
  inputs = np.where(valid, inputs, 0)
  inputs[np.arange(rows), lengths - 1] = 1
  return inputs, valid


def run_t5(version: str, root: str, seed: int, quick: bool, new_tokens: int) -> dict:
  import jax
  import jax.numpy as jnp
  import torch
  import transformers
  from transformer_jax.convert import hf_t5
  from transformer_jax.models.encoder_decoder import EncoderDecoder, shift_right
  from transformer_jax.tasks.translation import TranslationTask
  hf_model = _t5_model(version, seed)
  name = f't5_v{version.replace(".", "_")}'
  directory = save(hf_model, root, name)
  imported = hf_t5.load(directory)
  cfg, params = imported.config, imported.params
  rng = np.random.default_rng(seed)
  rows, source_length, target_length = (2, 8, 6) if quick else (3, 12, 10)
  inputs, valid = _t5_sources(rng, rows, source_length)
  targets = rng.integers(2, T5_VOCAB, (rows, target_length)).astype(np.int32)
  apply = jax.jit(EncoderDecoder(cfg).apply)
  ours = np.asarray(apply({'params': params}, jnp.asarray(inputs), jnp.asarray(targets)))

  def hf_logits(model):
    with torch.no_grad():
      return model(input_ids=torch.from_numpy(inputs).long(),
                   attention_mask=torch.from_numpy(valid.astype(np.int64)),
                   decoder_input_ids=torch.from_numpy(np.array(
                       shift_right(targets))).long()).logits.numpy()

  theirs = hf_logits(hf_model)
  figures = {'import_max_abs_diff': max_abs(ours, theirs)}

  predict = jax.jit(
      functools.partial(
          TranslationTask(cfg).predict_tokens, max_len=new_tokens, beam_size=1, alpha=0.6))
  generated = np.asarray(predict(params, jnp.asarray(inputs)))
  with torch.no_grad():
    hf_generated = hf_model.generate(input_ids=torch.from_numpy(inputs).long(),
                                     attention_mask=torch.from_numpy(valid.astype(np.int64)),
                                     do_sample=False, num_beams=1,
                                     max_new_tokens=new_tokens).numpy()
  # HF starts with the decoder start token (ours leaves it out) and stops once every row has
  # EOS; ours pads after EOS to max_len.
  hf_generated = hf_generated[:, 1:]
  hf_generated = np.pad(hf_generated, ((0, 0), (0, new_tokens - hf_generated.shape[1])))
  figures.update(agreement(generated, hf_generated))
  figures['greedy_lengths'] = [
      int(np.argmax(row == 1)) + 1 if (row == 1).any() else new_tokens for row in generated
  ]
  figures['greedy_distinct_ids'] = len(set(generated.ravel().tolist()))

  out, reloaded, info = export_and_reload(root, f'{name}_exported', hf_t5.t5_config_to_hf(cfg),
                                          hf_t5.export_t5_state_dict(cfg, params),
                                          transformers.AutoModelForSeq2SeqLM)
  figures['export_class'] = type(reloaded).__name__
  figures['export_max_abs_diff'] = max_abs(ours, hf_logits(reloaded))
  figures.update(loading_figures(info))
  again = hf_t5.load(out)
  figures['round_trip_bitwise'] = bitwise_equal(again.params, params)
  figures['round_trip_config_equal'] = again.config == cfg
  figures['max_abs_logit'] = float(np.abs(theirs).max())
  figures['shapes'] = {'logits': list(ours.shape), 'sources': list(inputs.shape)}
  return figures


# -- BERT-style encoders: BERT (and ALBERT, RoBERTa when present) --------------------------------


def _bert_inputs(rng, vocab: int, rows: int, length: int, low: int = 5):
  """(tokens, segments, valid): rows padded (with 0) after length, length // 2 and 5 tokens."""
  tokens = rng.integers(low, vocab, (rows, length)).astype(np.int32)
  lengths = np.array([length, length // 2, 5] * rows)[:rows]
  valid = np.arange(length)[None] < lengths[:, None]
  segments = ((np.arange(length)[None] >= lengths[:, None] // 2) & valid).astype(np.int32)
  return np.where(valid, tokens, 0), segments, valid


def _encoder(name: str, hf_model, directory: str, to_hf: Callable, export_state: Callable,
             auto_class, root: str, seed: int, quick: bool, hf_pad_id: int = 0, cls_id: int = 2,
             to_ours: Callable | None = None, with_segments: bool = True) -> dict:
  """Import, export and round trip of a `Bert`-architecture family with an MLM head.

  Imported by `families.named(name).load`. The batch is drawn in HF's ids (PAD `hf_pad_id`,
  each row starting with `cls_id`: [CLS] 2, RoBERTa's <s> 0); `to_ours` maps them to ours
  (RoBERTa's renumbering, its own inverse, so it also puts our logit columns in HF's order). MLM
  logits are compared at every real position (HF masks padding through attention_mask, ours by
  the PAD id), sentence logits when present. A checkpoint without a pooler (RobertaForMaskedLM)
  gets an initialised one for our forward pass only: the MLM logits do not read it, and the
  export and the round trip use the params as imported.
  """
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import torch
  from transformer_jax.convert import families
  from transformer_jax.models.bert import Bert
  to_ours = to_ours or (lambda ids: ids)
  imported = families.named(name).load(directory)
  cfg, params, heads = imported.config, imported.params, imported.heads
  rng = np.random.default_rng(seed)
  rows, length = (2, 12) if quick else (3, 20)
  hf_tokens, segments, valid = _bert_inputs(rng, cfg.vocab_size, rows, length)
  hf_tokens[:, 0] = cls_id
  hf_tokens = np.where(valid, hf_tokens, hf_pad_id)
  tokens = np.asarray(to_ours(hf_tokens), np.int32)
  if not with_segments:
    segments = np.zeros_like(segments)
  bert_heads = {k: heads[k] for k in ('type_vocab_size', 'mlm', 'sentence_classes', 'num_labels')}
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
  bert = Bert(cfg, **bert_heads)
  variables = dict(params)
  if 'pooler' not in variables:
    init = bert.init(jax.random.key(seed), tokens[:1], segments[:1], mlm_positions=positions[:1])
    variables['pooler'] = nn.meta.unbox(init['params'])['pooler']
  ours = jax.jit(bert.apply)({'params': variables}, jnp.asarray(tokens), jnp.asarray(segments),
                             mlm_positions=jnp.asarray(positions))
  ours = jax.tree.map(np.asarray, ours)
  ours_mlm = ours['mlm_logits'][..., np.asarray(to_ours(np.arange(cfg.vocab_size)))]

  def hf_outputs(model):
    with torch.no_grad():
      out = model(input_ids=torch.from_numpy(hf_tokens).long(),
                  token_type_ids=torch.from_numpy(segments).long(),
                  attention_mask=torch.from_numpy(valid.astype(np.int64)))
    logits = getattr(out, 'prediction_logits', None)
    if logits is None:
      logits = out.logits
    sentence = getattr(out, 'seq_relationship_logits', None)
    if sentence is None:
      sentence = getattr(out, 'sop_logits', None)
    return logits.numpy(), None if sentence is None else sentence.numpy()

  theirs, theirs_sentence = hf_outputs(hf_model)
  figures = {'import_max_abs_diff': max_abs(ours_mlm, theirs, valid)}
  if theirs_sentence is not None:
    figures['import_sentence_max_abs_diff'] = max_abs(ours['sentence_logits'], theirs_sentence)

  hf_config = to_hf(cfg, **bert_heads)
  out, reloaded, info = export_and_reload(root, f'{name}_exported', hf_config,
                                          export_state(cfg, params), auto_class)
  figures['export_class'] = type(reloaded).__name__
  exported, exported_sentence = hf_outputs(reloaded)
  figures['export_max_abs_diff'] = max_abs(ours_mlm, exported, valid)
  if exported_sentence is not None:
    figures['export_sentence_max_abs_diff'] = max_abs(ours['sentence_logits'], exported_sentence)
  figures.update(loading_figures(info))
  # The export has no tokenizer files (tokenizer_writer None): the importers that read one (BERT's
  # vocab.txt, RoBERTa's BPE) get the original's.
  for extra in ('vocab.txt', 'vocab.json', 'merges.txt', 'tokenizer.json', 'tokenizer_config.json',
                'special_tokens_map.json'):
    if os.path.exists(os.path.join(directory, extra)):
      shutil.copy(os.path.join(directory, extra), os.path.join(out, extra))
  again = families.named(name).load(out)
  figures['round_trip_bitwise'] = bitwise_equal(again.params, params)
  figures['round_trip_config_equal'] = again.config == cfg and again.heads == heads
  figures['max_abs_logit'] = float(np.abs(theirs[valid]).max())
  figures['shapes'] = {'mlm_logits': list(theirs.shape)}
  return figures


BERT_SMALL = dict(vocab_size=211, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=40, type_vocab_size=2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12,
                  hidden_act='gelu')


def _wordpiece_vocab(directory: str, size: int) -> None:
  words = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f'w{i}' for i in range(size - 5)]
  with open(os.path.join(directory, 'vocab.txt'), 'w', encoding='utf-8') as f:
    f.write('\n'.join(words) + '\n')


def run_bert(root: str, seed: int, quick: bool, new_tokens: int) -> dict:
  del new_tokens  # an encoder: nothing to generate
  import torch
  import transformers
  from transformer_jax.convert import hf_bert
  torch.manual_seed(seed)
  model = perturb(transformers.BertForPreTraining(transformers.BertConfig(**BERT_SMALL)), seed)
  directory = save(model, root, 'bert')
  _wordpiece_vocab(directory, BERT_SMALL['vocab_size'])
  return _encoder('bert', model, directory, hf_bert.bert_config_to_hf,
                  hf_bert.export_bert_state_dict, transformers.AutoModelForPreTraining, root, seed,
                  quick)


def run_albert(root: str, seed: int, quick: bool, new_tokens: int) -> dict:
  """ALBERT: factorised embedding (32 -> 64), one layer shared by 2, MLM + SOP heads."""
  del new_tokens
  import torch
  import transformers
  from transformer_jax.convert import hf_albert
  torch.manual_seed(seed)
  config = transformers.AlbertConfig(vocab_size=211, embedding_size=32, hidden_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=40,
                                     type_vocab_size=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                                     layer_norm_eps=1e-12, hidden_act='gelu_new')
  model = perturb(transformers.AlbertForPreTraining(config), seed)
  directory = save(model, root, 'albert')
  return _encoder('albert', model, directory, hf_albert.albert_config_to_hf,
                  hf_albert.export_albert_state_dict, transformers.AutoModelForPreTraining, root,
                  seed, quick)


def run_roberta(root: str, seed: int, quick: bool, new_tokens: int) -> dict:
  """RoBERTa (RobertaForMaskedLM): positions offset past padding_idx 1, one token type, <pad> 1
  (ours renumbers it to 0: hf_roberta.swap_ids), a byte-level BPE vocabulary beside it."""
  del new_tokens
  import torch
  import transformers
  from transformer_jax.convert import hf_roberta
  from transformer_jax.data.roberta_tokenizer import SPECIAL_TOKENS
  torch.manual_seed(seed)
  specials = list(SPECIAL_TOKENS)  # <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4
  config = transformers.RobertaConfig(
      vocab_size=len(specials) + 256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=128, max_position_embeddings=42, type_vocab_size=1, hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0, layer_norm_eps=1e-5, hidden_act='gelu', pad_token_id=1,
      bos_token_id=0, eos_token_id=2)
  model = perturb(transformers.RobertaForMaskedLM(config), seed)
  directory = save(model, root, 'roberta')
  _byte_level_vocabulary(directory, specials)
  pad = config.pad_token_id
  return _encoder('roberta', model, directory, hf_roberta.roberta_config_to_hf,
                  functools.partial(hf_roberta.export_roberta_state_dict, pad_token_id=pad),
                  transformers.AutoModelForMaskedLM, root, seed, quick, hf_pad_id=pad, cls_id=0,
                  to_ours=functools.partial(hf_roberta.swap_ids, pad_id=pad), with_segments=False)


def _byte_level_vocabulary(directory: str, specials: list[str]) -> None:
  """vocab.json + merges.txt of a byte-level BPE without merges: `specials`, then the 256 byte
  symbols (RoBERTa's importer reads the tokenizer with the weights)."""
  from tokenizers import pre_tokenizers
  symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
  with open(os.path.join(directory, 'vocab.json'), 'w', encoding='utf-8') as f:
    json.dump({token: i for i, token in enumerate(specials + symbols)}, f)
  with open(os.path.join(directory, 'merges.txt'), 'w', encoding='utf-8') as f:
    f.write('#version: 0.2\n')


RUNNERS: dict[str, Callable[..., dict]] = {
    'gpt2': run_gpt2,
    'llama': run_llama,
    'opt': run_opt,
    't5_v1_0': functools.partial(run_t5, '1.0'),
    't5_v1_1': functools.partial(run_t5, '1.1'),
    'bert': run_bert,
    'albert': run_albert,
    'roberta': run_roberta,
}


def available_families() -> list[str]:
  """The default families: the fixed ones, then the optional ones whose module is present."""
  import importlib.util
  optional = [
      name for name, module in OPTIONAL_FAMILIES.items()
      if importlib.util.find_spec(f'transformer_jax.convert.{module}') is not None
  ]
  return list(FAMILIES) + optional


def check_families(names: list[str] | None) -> list[str]:
  """The families to run, in the order given; ConfigError naming an unknown or absent one."""
  if not names:
    return available_families()
  known = list(FAMILIES) + list(OPTIONAL_FAMILIES)
  for name in names:
    if name not in known:
      raise ConfigError(f'--families: unknown family {name!r}; known: {",".join(known)}')
    if name in OPTIONAL_FAMILIES and name not in available_families():
      raise ConfigError(f'--families: {name} needs transformer_jax/convert/'
                        f'{OPTIONAL_FAMILIES[name]}.py, which this tree lacks')
  if len(set(names)) != len(names):
    raise ConfigError(f'--families names a family twice: {",".join(names)}')
  return list(names)


def summary_line(name: str, f: dict) -> str:
  parts = [f'import max|diff| {f["import_max_abs_diff"]:.2e}']
  if 'greedy_total' in f:
    parts.append(f'greedy {f["greedy_identical"]}/{f["greedy_total"]} identical')
  parts.append(f'export max|diff| {f["export_max_abs_diff"]:.2e}')
  parts.append('round trip ' + ('bitwise' if f['round_trip_bitwise'] else 'DIFFERENT'))
  parts.append(f'max|logit| {f["max_abs_logit"]:.2f}')
  worst = max(f['import_max_abs_diff'], f['export_max_abs_diff'])
  ok = (worst <= TOLERANCE and f['round_trip_bitwise'] and f.get('greedy_agreement', 1.0) == 1.0 and
        not f['export_missing_keys'] and not f['export_unexpected_keys'])
  verdict = 'ok' if ok else 'CHECK'
  return f'{name:8s}: {", ".join(parts)} ({f["seconds"]:.1f} s) [{verdict}]'


def main(argv):
  if len(argv) > 1:
    raise ConfigError(f'unexpected arguments {argv[1:]}; options are --flag=value')
  families = check_families(_FAMILIES.value)
  new_tokens = 8 if _QUICK.value and _NEW_TOKENS.present == 0 else _NEW_TOKENS.value
  if new_tokens < 1:
    raise ConfigError(f'--new_tokens must be positive, got {new_tokens}')
  start = time.time()
  log(f'families: {",".join(families)}; seed {_SEED.value}; {new_tokens} greedy tokens; '
      f'importing jax, torch, transformers ...')
  import jax
  if _PRECISION.value != 'default':
    jax.config.update('jax_default_matmul_precision', _PRECISION.value)
  import torch
  import transformers
  from absl import logging
  # The per-family lines are the progress: no converters' INFO lines, no HF progress bars
  # (loading info is reported in the figures instead).
  logging.set_verbosity(logging.WARNING)
  transformers.logging.set_verbosity_error()
  transformers.logging.disable_progress_bar()
  torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
  results = {}
  root = tempfile.mkdtemp(prefix='hf_parity_')
  try:
    for name in families:
      t0 = time.time()
      figures = RUNNERS[name](root, _SEED.value, _QUICK.value, new_tokens)
      figures['seconds'] = round(time.time() - t0, 2)
      results[name] = figures
      log(summary_line(name, figures))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  wall = time.time() - start
  log(f'{len(results)} famil{"y" if len(results) == 1 else "ies"} in {wall:.0f} s')
  print(
      json.dumps({
          'benchmark': 'hf_parity', 'date': datetime.datetime.now(datetime.timezone.utc
                                                                 ).isoformat(timespec='seconds'),
          'commit': machine.git_commit(), 'cpu': machine.cpu_model(),
          'transformers': transformers.__version__, 'torch': torch.__version__,
          'jax': jax.__version__, 'backend': jax.default_backend(), 'seed': _SEED.value,
          'quick': _QUICK.value, 'new_tokens': new_tokens, 'matmul_precision': _PRECISION.value,
          'tolerance': TOLERANCE, 'wall_seconds': round(wall, 1), 'families': results
      }))


def _run(argv):
  try:
    return main(argv)
  except UserError as error:
    from transformer_jax.cli.entrypoint import exit_with_error
    exit_with_error(str(error))


if __name__ == '__main__':
  app.run(_run)
