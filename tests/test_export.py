"""Export to Hugging Face directories (transformer_jax/convert/export.py: the HF format;
transformer_jax/workflows/export.py: a trained workdir; experiments/export.py: the command).

Tiny workdirs of every exportable family are trained in-process for a few steps (a character
GPT-2 and a character LLaMA on Tiny Shakespeare, a BERT pretrained and then fine-tuned, an ALBERT
and a RoBERTa pretrained, a T5-style translation model on the numbers corpus), exported, and
loaded with transformers: the same outputs (max |difference| <= 1e-4 in float32), the same token
ids, and import(export(params)) equal to the params the workflow restores, bit for bit. Models
with random params cover what training here does not (untied GPT-2 head, scanned layers, each
BERT head). The parity tests need the `parity` extra (torch, transformers, safetensors); no
download: every reference model is built from the exported files.
"""

import json
import os
import random
import shutil
import subprocess
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO_ROOT, TranslateCli, set_path, tiny_translate_config

from transformer_jax.convert import export, hf_bert, hf_gpt2
from transformer_jax.errors import ConfigError
from transformer_jax.workflows.export import export_workdir

TOLERANCE = 1e-4
TINY_CHAR = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_decoder_layers': 2,
    'data.block_size': 16, 'data.batch_size': 8, 'data.eval_batches': 1,
    'optimizer.learning_rate': 1e-2, 'optimizer.warmup_steps': 1, 'optimizer.decay_steps': 8,
    'train.num_steps': 8, 'train.log_every': 8, 'train.eval_every': 0, 'train.checkpoint_every': 0,
    'train.eval_max_batches': 1, 'eval.sample_tokens': 0
}
TINY_BERT = {
    'model.emb_dim': 32, 'model.num_heads': 2, 'model.mlp_dim': 64, 'model.num_encoder_layers': 2,
    'model.max_len': 32, 'train.num_steps': 4, 'train.log_every': 4, 'train.eval_every': 0,
    'train.checkpoint_every': 0, 'optimizer.learning_rate': 1e-2, 'optimizer.warmup_steps': 1,
    'optimizer.decay_steps': 4, 'data.lines_per_document': 0, 'data.valid_fraction': 0.1,
    'data.max_len': 32, 'data.max_predictions': 5, 'data.batch_size': 8, 'data.eval_batches': 1,
    'tokenizer.vocab_size': 100
}


def _transformers():
  pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
  return pytest.importorskip('transformers',
                             reason='needs the parity extra: pip install -e ".[parity]"')


def _flat(params) -> dict:
  return flax.traverse_util.flatten_dict(jax.device_get(params), sep='/')


def _assert_bitwise_equal(got, expected):
  got, expected = _flat(got), _flat(expected)
  assert sorted(got) == sorted(expected)
  for name, value in expected.items():
    assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def _random_params(module, *args, seed: int = 0, std: float = 0.05, **kwargs) -> dict:
  """Params of `module` with every entry random: norm scales 1 + N(0, std^2), everything else
  N(0, std^2). (Init's zero biases and unit norms would hide a mis-mapped bias or norm.) Only
  shapes are traced, nothing is compiled."""
  shapes = nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0), *args, **kwargs))['params']
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    value = std * rng.standard_normal(leaf.shape).astype(np.float32)
    return value + 1 if getattr(path[-1], 'key', None) == 'scale' else value

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _files(directory) -> dict:
  """{path: (size, mtime)} of everything under `directory`: to prove nothing was written."""
  out = {}
  for root, dirs, names in os.walk(directory):
    for name in dirs + names:
      path = os.path.join(root, name)
      out[path] = (os.path.getsize(path), os.stat(path).st_mtime_ns)
  return out


def _leftovers(parent) -> list[str]:
  return [name for name in os.listdir(parent) if '.tmp-' in name]


def _export_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'experiments.export', *args], cwd=REPO_ROOT,
                        env=TranslateCli.env(), capture_output=True, text=True, timeout=600,
                        check=False)


def _error_lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith('error:')]


# -- trained workdirs -----------------------------------------------------------------------------


def _train_lm(tmp_path_factory, name: str, config, overrides: dict) -> tuple[str, object]:
  """`config` (experiments.lm's) with TINY_CHAR's sizes, then `overrides`, trained with the
  workflow: (workdir, config)."""
  from transformer_jax.workflows import lm
  for key, value in dict(TINY_CHAR, **overrides).items():
    set_path(config, key, value)
  workdir = str(tmp_path_factory.mktemp(name) / 'work')
  lm.train_and_evaluate(config, workdir)
  return workdir, config


@pytest.fixture(scope='module')
def char_workdir(tmp_path_factory, tiny_shakespeare):
  """A character GPT-2 trained 8 steps on Tiny Shakespeare: (workdir, config)."""
  from experiments.configs import shakespeare_char
  return _train_lm(tmp_path_factory, 'char', shakespeare_char.get_config(),
                   {'data.path': tiny_shakespeare})


@pytest.mark.slow
@pytest.mark.parity
def test_char_gpt2_workdir_loads_in_transformers(char_workdir, tmp_path, tiny_shakespeare):
  transformers = _transformers()
  from transformer_jax.models.gpt import GPT
  from transformer_jax.workflows import lm
  workdir, config = char_workdir
  before = _files(workdir)
  out = str(tmp_path / 'hf')
  result = _export_cli(f'--workdir={workdir}', f'--out={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout == f'{out} gpt2\n'
  assert _files(workdir) == before  # export reads the workdir and writes nothing there
  assert sorted(os.listdir(out)) == [
      'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'
  ]
  assert not _leftovers(tmp_path)

  trained = lm.restore_for_inference(config, workdir)  # the workflow's
  task, tokenizer, params = trained.task, trained.tokenizer, trained.params
  model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
  assert type(model).__name__ == 'GPT2LMHeadModel'
  assert not info['missing_keys'] and not info['unexpected_keys'], info

  with open(tiny_shakespeare, encoding='utf-8') as f:
    text = f.read()[:4000]
  line = text[1000:1200]  # several lines: newlines, punctuation, capitals
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tokenizer.encode(line, add_special_tokens=False) == tokenizer.encode(line)
  assert len(hf_tokenizer) == tokenizer.vocab_size
  assert hf_tokenizer.decode(tokenizer.encode(line)) == line

  tokens = np.asarray([tokenizer.encode(text[i:i + 16]) for i in (0, 500, 3000)], np.int32)
  ours = np.asarray(GPT(task.cfg).apply({'params': params}, jnp.asarray(tokens)))
  import torch
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
  assert np.abs(theirs).max() > 0.5  # not a comparison of near-zero logits
  difference = float(np.abs(ours - theirs).max())
  print(f'char GPT-2 workdir: max |logits difference| = {difference:.3g}')
  assert difference <= TOLERANCE

  imported_model = hf_gpt2.load(out)
  cfg, imported = imported_model.config, imported_model.params
  _assert_bitwise_equal(imported, params)
  fields = ('vocab_size', 'emb_dim', 'num_heads', 'mlp_dim', 'num_decoder_layers', 'max_len',
            'activation', 'norm_epsilon', 'tie_output', 'position', 'norm_position')
  assert [getattr(cfg, f) for f in fields] == [getattr(task.cfg, f) for f in fields]


def _pretrain(tmp_path_factory, name: str, get_config, overrides: dict | None = None) -> str:
  """A BERT-family model pretrained 4 steps on random sentences (TINY_BERT sizes, then
  `overrides`) with experiments.bert's workflow: the workdir."""
  from transformer_jax.workflows import bert
  root = tmp_path_factory.mktemp(name)
  words = 'The cat sat on a mat while dogs ran in the park and birds sang songs'.split()
  rng = random.Random(0)
  docs = [
      '\n'.join(' '.join(rng.choice(words) for _ in range(8)) for _ in range(5)) for _ in range(40)
  ]
  (root / 'text.txt').write_text('\n\n'.join(docs) + '\n')
  config = get_config()
  for key, value in dict(TINY_BERT, **{'data.paths': str(root / 'text.txt')}, **(overrides or
                                                                                 {})).items():
    set_path(config, key, value)
  workdir = str(root / 'work')
  bert.pretrain(config, workdir)
  return workdir


@pytest.fixture(scope='module')
def bert_workdir(tmp_path_factory):
  """A BERT (MLM + NSP) pretrained 4 steps on random sentences: the workdir."""
  from experiments.configs import bert_pretrain_small
  return _pretrain(tmp_path_factory, 'bert', bert_pretrain_small.get_config)


@pytest.fixture(scope='module')
def albert_workdir(tmp_path_factory):
  """An ALBERT (factorised embedding E=16 < D=32, one shared layer applied twice, MLM + SOP,
  WordPiece) pretrained 4 steps: the workdir."""
  from experiments.configs import albert_pretrain_small
  return _pretrain(tmp_path_factory, 'albert', albert_pretrain_small.get_config,
                   {'model.embedding_size': 16})


@pytest.fixture(scope='module')
def roberta_workdir(tmp_path_factory):
  """A RoBERTa (MLM on full sentences, one segment id, a byte-level BPE in WORKDIR/tokenizer/)
  pretrained 4 steps: the workdir."""
  from experiments.configs import roberta_pretrain_small
  return _pretrain(tmp_path_factory, 'roberta', roberta_pretrain_small.get_config,
                   {'tokenizer.vocab_size': 300})


PAIRS = [('The Cat sat on a mat', 'dogs RAN in the park'), ('birds sang songs',)]


def _pair_batch(tokenizer, pairs=PAIRS, length: int = 24):
  """(tokens, segments) [len(pairs), length] of `tokenizer.encode_pair` rows, zero-padded."""
  tokens = np.zeros((len(pairs), length), np.int32)
  segments = np.zeros_like(tokens)
  for i, pair in enumerate(pairs):
    ids, types = tokenizer.encode_pair(*pair)
    tokens[i, :len(ids)], segments[i, :len(ids)] = ids, types
  return tokens, segments


def _check_pair_ids(hf_tokenizer, tokenizer, to_hf=list):
  """The exported tokenizer gives the workdir's ids (in HF's numbering, `to_hf`) for a pair
  (special tokens and segments included) and for bare text (capitals: lowercasing counts)."""
  first, second = PAIRS[0]
  ids, segments = tokenizer.encode_pair(first, second)
  encoded = hf_tokenizer(first, second)
  assert encoded['input_ids'] == list(to_hf(ids))
  assert encoded.get('token_type_ids', segments) == segments
  assert hf_tokenizer.encode(first,
                             add_special_tokens=False) == list(to_hf(tokenizer.encode(first)))


def _pretraining_differences(model, cfg, params, tokens, segments, to_hf=None) -> dict:
  """max |ours - HF `model`'s| of the MLM logits at a few positions and of the sentence head's
  logits (if the params have one) on a zero-padded batch of our ids; `to_hf` maps our ids to
  HF's (RoBERTa's swapped numbering), for the inputs and the order of the logits' columns."""
  import torch
  from transformer_jax.models.bert import Bert
  heads = hf_bert.bert_heads(params)
  positions = np.asarray([[1, 3, 6], [0, 2, 4]], np.int32)
  ours = Bert(cfg, **heads).apply({'params': params}, tokens, segments, mlm_positions=positions)
  hf_ids = tokens if to_hf is None else np.asarray(to_hf(tokens))
  with torch.no_grad():
    theirs = model(input_ids=torch.from_numpy(hf_ids).long(),
                   token_type_ids=torch.from_numpy(segments).long(),
                   attention_mask=torch.from_numpy((tokens != 0).astype(np.int64)))
  logits = getattr(theirs, 'prediction_logits', None)
  logits = (theirs.logits if logits is None else logits).numpy()
  mlm = np.take_along_axis(logits, positions[..., None], axis=1)
  if to_hf is not None:  # our column j is HF's column to_hf(j)
    mlm = mlm[..., np.asarray(to_hf(np.arange(cfg.vocab_size)))]
  assert np.abs(mlm).max() > 0.1  # not a comparison of near-zero logits
  differences = {'mlm_logits': float(np.abs(np.asarray(ours['mlm_logits']) - mlm).max())}
  if heads['sentence_classes']:  # BERT's NSP or ALBERT's SOP head
    sentence = getattr(theirs, 'seq_relationship_logits', None)
    sentence = theirs.sop_logits if sentence is None else sentence
    differences['sentence_logits'] = float(
        np.abs(np.asarray(ours['sentence_logits']) - sentence.numpy()).max())
  return differences


def _export_and_load(workdir: str, tmp_path, family: str, hf_class: str, auto_class: str,
                     files=None, unused: str = ''):
  """Exports `workdir` to tmp_path/hf (export_workdir must name `family` and, if given, write
  exactly `files`) and loads it with transformers' `auto_class`, which must build `hf_class`
  and use every weight (`unused`: a prefix of weights it may ignore). (out, model)."""
  transformers = _transformers()
  out = str(tmp_path / 'hf')
  assert export_workdir(workdir, out) == family
  assert files is None or sorted(os.listdir(out)) == sorted(files)
  with open(os.path.join(out, 'config.json')) as f:
    assert json.load(f)['architectures'] == [hf_class]
  model, info = getattr(transformers, auto_class).from_pretrained(out, output_loading_info=True)
  assert type(model).__name__ == hf_class
  assert not info['missing_keys'], info
  assert all(unused and k.startswith(unused) for k in info['unexpected_keys']), info
  return out, model


WORDPIECE_FILES = ('config.json', 'model.safetensors', 'tokenizer_config.json', 'vocab.txt')
# family -> (HF class, Auto class, files written, weights HF may leave unused, the heads).
PRETRAINED = {
    'bert': ('BertForPreTraining', 'AutoModelForPreTraining', WORDPIECE_FILES, '',
             dict(mlm=True, sentence_classes=2, num_labels=0, type_vocab_size=2)),
    'albert': ('AlbertForPreTraining', 'AutoModelForPreTraining', WORDPIECE_FILES, '',
               dict(mlm=True, sentence_classes=2, num_labels=0, type_vocab_size=2)),
    # Our pooler (kept for the round trip and for fine-tuning) is unused by RobertaForMaskedLM.
    'roberta': ('RobertaForMaskedLM', 'AutoModelForMaskedLM',
                ('config.json', 'merges.txt', 'model.safetensors', 'special_tokens_map.json',
                 'tokenizer.json', 'tokenizer_config.json', 'vocab.json'), 'roberta.pooler.',
                dict(mlm=True, sentence_classes=0, num_labels=0, type_vocab_size=1)),
}


def _import_bert_family(family: str, directory: str):
  """(cfg, params, tokenizer or None, heads) of an exported BERT, ALBERT or RoBERTa."""
  from transformer_jax.convert import families
  imported = families.named(family).load(directory)  # ALBERT's reads no tokenizer: None
  return imported.config, imported.params, imported.tokenizer, imported.heads


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize('family', sorted(PRETRAINED))
def test_pretraining_workdir_loads_in_transformers(family, request, tmp_path):
  """A BERT (MLM + NSP), an ALBERT (E=16 < D=32, one shared layer; MLM + SOP) and a RoBERTa
  (MLM, byte-level BPE in swapped ids) pretraining workdir: HF's class of their heads, the
  same token ids, the same MLM (and sentence) logits, and the import gives the params back."""
  from transformer_jax.workflows import bert
  workdir = request.getfixturevalue(f'{family}_workdir')
  hf_class, auto_class, files, unused, heads = PRETRAINED[family]
  out, model = _export_and_load(workdir, tmp_path, family, hf_class, auto_class, files, unused)
  cfg, params, tokenizer = bert.restore_pretrained(workdir)  # the workflow's restore
  to_hf = tokenizer.to_hf if family == 'roberta' else None  # RoBERTa's ids: 0 and pad swapped
  hf_tokenizer = _transformers().AutoTokenizer.from_pretrained(out)
  _check_pair_ids(hf_tokenizer, tokenizer, to_hf or list)
  assert hf_tokenizer.mask_token_id == (to_hf or list)([tokenizer.mask_id])[0]
  differences = _pretraining_differences(model, cfg, params, *_pair_batch(tokenizer), to_hf=to_hf)
  print(f'{family} pretraining workdir: max |difference| {differences}')
  assert len(differences) == 1 + bool(heads['sentence_classes'])
  assert max(differences.values()) <= TOLERANCE
  if family == 'albert':
    assert (cfg.embedding_size, cfg.emb_dim, cfg.share_layers) == (16, 32, True)
  if family == 'roberta':
    assert model.config.pad_token_id == tokenizer.hf_pad_id == 1

  imported_cfg, imported, imported_tokenizer, imported_heads = _import_bert_family(family, out)
  assert imported_heads == heads
  _assert_bitwise_equal(imported, params)
  fields = ('vocab_size', 'embedding_size', 'emb_dim', 'share_layers', 'num_encoder_layers',
            'max_len', 'activation', 'norm_epsilon')
  assert [getattr(imported_cfg, f) for f in fields] == [getattr(cfg, f) for f in fields]
  if imported_tokenizer is not None:  # capitals in the pair: the same lowercasing
    assert imported_tokenizer.vocab_size == tokenizer.vocab_size
    assert imported_tokenizer.encode_pair(*PAIRS[0]) == tokenizer.encode_pair(*PAIRS[0])


@pytest.fixture(scope='module')
def finetuned_workdir(bert_workdir, tmp_path_factory):
  """`bert_workdir` fine-tuned 3 steps on a 2-class sentence task: (workdir, config)."""
  from experiments.configs import sst2_minilm
  from transformer_jax.workflows import bert
  root = tmp_path_factory.mktemp('finetuned')
  rows = [(1, 'a great and lovely film'), (0, 'a dull and boring mess'),
          (1, 'lovely songs and great cats'), (0, 'boring dogs in a dull park')] * 6
  (root / 'train.tsv').write_text('label\tsentence\n' + ''.join(f'{y}\t{s}\n' for y, s in rows))
  (root / 'dev.tsv').write_text('label\tsentence\n' + ''.join(f'{y}\t{s}\n' for y, s in rows[:8]))
  config = sst2_minilm.get_config()
  for key, value in {
      'init.hf_dir': '', 'init.bert_workdir': bert_workdir, 'data.dir': str(root),
      'data.max_len': 16, 'data.batch_size': 8, 'train.num_steps': 3, 'train.log_every': 3,
      'train.eval_every': 0, 'train.checkpoint_every': 0, 'optimizer.learning_rate': 1e-2,
      'optimizer.warmup_steps': 1, 'optimizer.decay_steps': 3
  }.items():
    set_path(config, key, value)
  workdir = str(root / 'work')
  bert.finetune(config, workdir)
  return workdir, config


@pytest.mark.slow
@pytest.mark.parity
def test_finetuned_bert_workdir_loads_in_transformers(finetuned_workdir, tmp_path):
  workdir, config = finetuned_workdir
  out, model = _export_and_load(workdir, tmp_path, 'bert', 'BertForSequenceClassification',
                                'AutoModelForSequenceClassification', WORDPIECE_FILES)
  transformers = _transformers()
  import torch
  from transformer_jax.models.bert import Bert
  from transformer_jax.tasks.bert import BertClassificationTask
  from transformer_jax.training.trainer import Trainer
  from transformer_jax.workflows import bert
  assert model.config.num_labels == 2
  cfg, _, tokenizer, _ = bert.load_init(config)  # restored as workflows/bert.py finetune does
  trainer = Trainer(config, BertClassificationTask(cfg, 2), workdir)
  params = jax.device_get(trainer.restore_params())
  trainer.close()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  texts = ['A great and lovely film', 'boring DOGS in a park']
  encoded = hf_tokenizer(texts, padding='max_length', max_length=16)
  tokens = np.zeros((2, 16), np.int32)
  for i, text in enumerate(texts):
    ids, _ = tokenizer.encode_pair(text)
    assert encoded['input_ids'][i][:len(ids)] == ids
    tokens[i, :len(ids)] = ids
  np.testing.assert_array_equal(np.asarray(encoded['input_ids']), tokens)
  ours = Bert(cfg, mlm=False, sentence_classes=0, num_labels=2).apply({'params': params}, tokens)
  with torch.no_grad():
    theirs = model(input_ids=torch.from_numpy(tokens).long(),
                   attention_mask=torch.from_numpy(np.asarray(encoded['attention_mask'])),
                   output_hidden_states=True)
  valid = tokens != 0
  hidden = theirs.hidden_states[-1].numpy()[valid]
  differences = {
      'hidden': float(np.abs(np.asarray(ours['hidden'])[valid] - hidden).max()),
      'class_logits': float(np.abs(np.asarray(ours['class_logits']) - theirs.logits.numpy()).max())
  }
  print(f'fine-tuned BERT workdir: max |difference| {differences}')
  # Three steps leave the classifier's logits small; the encoder's output is not.
  assert np.abs(hidden).max() > 0.5 and max(differences.values()) <= TOLERANCE
  imported_model = hf_bert.load(out)
  imported, heads = imported_model.params, imported_model.heads
  assert heads == {'mlm': False, 'sentence_classes': 0, 'num_labels': 2, 'type_vocab_size': 2}
  _assert_bitwise_equal(imported, params)


@pytest.fixture(scope='module')
def llama_workdir(tmp_path_factory, tiny_shakespeare):
  """A character LLaMA (rotary, RMSNorm, SwiGLU, grouped-query, untied) trained 4 steps."""
  from experiments.configs import llama_shakespeare
  return _train_lm(
      tmp_path_factory, 'llama', llama_shakespeare.get_config(), {
          'data.path': tiny_shakespeare, 'model.num_heads': 4, 'model.num_kv_heads': 2,
          'model.num_decoder_layers': 1, 'train.num_steps': 4, 'optimizer.decay_steps': 4
      })


@pytest.mark.slow
@pytest.mark.parity
def test_llama_workdir_loads_in_transformers(llama_workdir, tmp_path, tiny_shakespeare):
  transformers = _transformers()
  import torch
  from transformer_jax.convert import hf_llama
  from transformer_jax.models.gpt import GPT
  from transformer_jax.workflows import lm
  workdir, config = llama_workdir
  out, model = _export_and_load(workdir, tmp_path, 'llama', 'LlamaForCausalLM',
                                'AutoModelForCausalLM')
  trained = lm.restore_for_inference(config, workdir)
  task, tokenizer, params = trained.task, trained.tokenizer, trained.params
  with open(tiny_shakespeare, encoding='utf-8') as f:
    text = f.read()[:4000]
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tokenizer.encode(text[:300], add_special_tokens=False) == tokenizer.encode(text[:300])
  tokens = np.asarray([tokenizer.encode(text[i:i + 16]) for i in (0, 2000)], np.int32)
  ours = np.asarray(GPT(task.cfg).apply({'params': params}, jnp.asarray(tokens)))
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
  difference = float(np.abs(ours - theirs).max())
  print(f'char LLaMA workdir: max |logits difference| = {difference:.3g}')
  assert np.abs(theirs).max() > 0.5 and difference <= TOLERANCE
  imported = hf_llama.load(out).params
  _assert_bitwise_equal(imported, params)


@pytest.fixture(scope='module')
def t5_workdir(tmp_path_factory):
  """A T5 v1.1-style translation model (numbers corpus; 3 sentinel ids, a source prefix)
  trained 3 steps: (workdir, config)."""
  from transformer_jax.models.encoder_decoder import T5_V1_1_ARCHITECTURE
  from transformer_jax.workflows import translation
  config = tiny_translate_config(train__num_steps=3, train__log_every=3,
                                 data__max_train_examples=200)
  config.model.update(T5_V1_1_ARCHITECTURE)
  config.tokenizer.num_sentinels = 3
  config.data.source_prefix = 'translate: '
  workdir = str(tmp_path_factory.mktemp('t5') / 'work')
  translation.train_and_evaluate(config, workdir)
  return workdir, config


@pytest.mark.slow
@pytest.mark.parity
def test_t5_workdir_loads_in_transformers(t5_workdir, tmp_path):
  transformers = _transformers()
  import torch
  from transformer_jax.convert import hf_t5
  from transformer_jax.models.encoder_decoder import EncoderDecoder
  from transformer_jax.special_tokens import EOS_ID
  from transformer_jax.workflows import translation
  workdir, config = t5_workdir
  out, model = _export_and_load(workdir, tmp_path, 't5', 'T5ForConditionalGeneration',
                                'AutoModelForSeq2SeqLM')
  with open(os.path.join(out, 'config.json')) as f:
    hf_config = json.load(f)
  assert hf_config['task_specific_params'] == {'translation': {'prefix': 'translate: '}}
  trained = translation.restore_for_inference(config, workdir)
  task, params = trained.task, trained.params

  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert len(hf_tokenizer) == task.cfg.vocab_size == hf_config['vocab_size']
  sources = ['one hundred and five', 'she bought forty-two flowers']
  for source in sources:  # the workflow's tokenizer adds the prefix: HF's user does
    assert hf_tokenizer.encode('translate: ' + source,
                               add_special_tokens=False) == task.src_tokenizer.encode(source)
  corrupted = 'she <extra_id_0> forty <extra_id_2> flowers'
  assert hf_tokenizer.encode(corrupted,
                             add_special_tokens=False) == (task.tgt_tokenizer.encode(corrupted))
  assert hf_tokenizer.convert_tokens_to_ids('<extra_id_0>') == task.cfg.vocab_size - 1

  rows = [task.src_tokenizer.encode(s) + [EOS_ID] for s in sources]
  targets_rows = [task.tgt_tokenizer.encode(t) + [EOS_ID] for t in ('eins', 'zwei und vierzig')]
  inputs = np.zeros((2, max(map(len, rows))), np.int32)
  targets = np.zeros((2, max(map(len, targets_rows))), np.int32)
  for i, (a, b) in enumerate(zip(rows, targets_rows)):
    inputs[i, :len(a)], targets[i, :len(b)] = a, b
  ours = np.asarray(EncoderDecoder(task.cfg).apply({'params': params}, inputs, targets))
  decoder_inputs = np.pad(targets[:, :-1], ((0, 0), (1, 0)))  # start with PAD, as T5
  with torch.no_grad():
    theirs = model(input_ids=torch.from_numpy(inputs).long(), attention_mask=torch.from_numpy(
        (inputs != 0).astype(np.int64)),
                   decoder_input_ids=torch.from_numpy(decoder_inputs).long()).logits.numpy()
  valid = targets != 0
  difference = float(np.abs(ours - theirs)[valid].max())
  print(f'T5 workdir: max |logits difference| = {difference:.3g}')
  assert np.abs(theirs[valid]).max() > 0.5 and difference <= TOLERANCE
  imported = hf_t5.load(out).params
  _assert_bitwise_equal(imported, params)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_input_is_one_error_line_and_writes_nothing(char_workdir, tmp_path):
  workdir, _ = char_workdir
  taken = tmp_path / 'taken'
  taken.mkdir()
  (taken / 'keep.txt').write_text('mine')
  result = _export_cli(f'--workdir={workdir}', f'--out={taken}')
  assert result.returncode == 1 and 'Traceback' not in result.stderr
  assert _error_lines(result.stderr) == [
      f'error: {taken} exists and is not an empty directory: choose a new --out (an export never '
      'overwrites files)'
  ]
  assert os.listdir(taken) == ['keep.txt'] and (taken / 'keep.txt').read_text() == 'mine'

  result = _export_cli(f'--workdir={workdir}')
  assert result.returncode == 1
  assert _error_lines(
      result.stderr) == ['error: --out is required: a new directory for the Hugging Face model']


def test_model_without_hf_equivalent_is_refused_from_its_config(tmp_path):
  # The original Transformer (post-LN, sinusoidal positions): refused from its config alone,
  # before any checkpoint is looked for.
  from transformer_jax.cli.workdir import save_config
  save_config(tiny_translate_config(), str(tmp_path))
  with pytest.raises(ConfigError) as info:
    export_workdir(str(tmp_path), str(tmp_path / 'out'))
  assert str(info.value) == (
      "no Hugging Face class computes this translation model: position='sinusoidal' has no "
      "equivalent (the original Transformer has none; T5 needs position='relative', "
      "norm_type='rmsnorm', norm_position='pre', use_bias=False)")
  assert os.listdir(tmp_path) == ['config.json']


@pytest.mark.parametrize('case', ['albert_byte_bpe', 'roberta_nsp'])
def test_bert_family_without_hf_class_is_refused_from_its_config(tmp_path, case):
  # An ALBERT with RoBERTa's byte-level BPE; a RoBERTa (byte-level BPE) with a next-sentence
  # head: no HF class holds either, refused before any tokenizer or checkpoint is read.
  from experiments.configs import albert_pretrain_small, roberta_pretrain_small
  from transformer_jax.cli.workdir import save_config
  if case == 'albert_byte_bpe':
    config, expected = albert_pretrain_small.get_config(), r'^an ALBERT .* byte-level BPE has no'
    config.tokenizer.type = 'byte_bpe'
  else:
    config, expected = roberta_pretrain_small.get_config(), '^RoBERTa has no next-sentence'
    config.data.sentence_task = 'nsp'
  save_config(config, str(tmp_path))
  with pytest.raises(ConfigError, match=expected):
    export_workdir(str(tmp_path), str(tmp_path / 'out'))
  assert os.listdir(tmp_path) == ['config.json']


@pytest.mark.slow
def test_workdir_without_checkpoint_or_with_a_larger_tokenizer_is_refused(char_workdir, tmp_path):
  workdir, _ = char_workdir
  bare = tmp_path / 'bare'
  bare.mkdir()
  for name in ('config.json', 'tokenizer.json'):
    shutil.copy(os.path.join(workdir, name), bare / name)
  with pytest.raises(ConfigError, match=r'no checkpoint in .*bare/checkpoints: train first'):
    export_workdir(str(bare), str(tmp_path / 'out'))

  bigger = tmp_path / 'bigger'
  shutil.copytree(workdir, bigger)
  with open(bigger / 'tokenizer.json') as f:
    chars = json.load(f)['chars']
  (bigger / 'tokenizer.json').write_text(json.dumps({'type': 'char', 'chars': chars + ['~', '|']}))
  with pytest.raises(ConfigError) as info:
    export_workdir(str(bigger), str(tmp_path / 'out'))
  assert str(info.value) == (f'the tokenizer has {len(chars) + 2} tokens but the model embedding '
                             f'has {len(chars)} rows: ids >= {len(chars)} would have no embedding')
  with pytest.raises(ConfigError, match='has no config.json'):
    export_workdir(str(tmp_path), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists() and not _leftovers(tmp_path)


def test_restore_params_only_falls_back_and_writes_nothing(tmp_path, caplog):
  """training/checkpointing.restore_params_only: the latest readable checkpoint's params alone
  (no optimizer state), as numpy arrays; a corrupted latest step is logged and the one before
  read; nothing is written; no readable step (or no directory) is one ConfigError."""
  import logging
  from transformer_jax.training import checkpointing
  caplog.set_level(logging.INFO, logger='absl')
  directory = tmp_path / 'checkpoints'
  states = {
      step: {
          'params': {
              'dense': {'kernel': np.full((3, 2), step, np.float32)},
              'bias': np.arange(4, dtype=np.float32)
          }, 'opt': np.ones(5, np.float32) * step
      } for step in (1, 2)
  }
  checkpointer = checkpointing.Checkpointer(str(directory), save_every=1)
  try:
    for step, state in states.items():
      checkpointer.maybe_save(step, jax.tree.map(jnp.asarray, state), {'position': step})
  finally:
    checkpointer.close()
  params = checkpointing.restore_params_only(str(directory))
  assert isinstance(params['dense']['kernel'], np.ndarray)
  _assert_bitwise_equal(params, states[2]['params'])

  for root, _, names in os.walk(directory / '2' / 'state'):  # garbage of another size
    for name in names:
      (directory / root / name).write_bytes(b'\x00garbage')
  before = _files(tmp_path)
  _assert_bitwise_equal(checkpointing.restore_params_only(str(directory)), states[1]['params'])
  assert 'checkpoint at step 2' in caplog.text and 'trying an older one' in caplog.text
  assert _files(tmp_path) == before
  with pytest.raises(ConfigError, match=r'no checkpoint in .*/elsewhere: train first'):
    checkpointing.restore_params_only(str(tmp_path / 'elsewhere'))
  assert not (tmp_path / 'elsewhere').exists()
  shutil.rmtree(directory / '1' / 'state')
  with pytest.raises(ConfigError, match=r'no readable checkpoint in .*/checkpoints: train first'):
    checkpointing.restore_params_only(str(directory))


@pytest.mark.parity
def test_write_hf_directory_is_all_or_nothing(tmp_path):
  safetensors_numpy = pytest.importorskip('safetensors.numpy')
  state = {'w': np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]}  # not contiguous

  def failing(directory):
    (open(os.path.join(directory, 'tokenizer.json'), 'w')).close()
    raise RuntimeError('tokenizer writer failed')

  with pytest.raises(RuntimeError, match='tokenizer writer failed'):
    export.write_hf_directory(str(tmp_path / 'a'), {'model_type': 'x'}, state, failing)
  assert os.listdir(tmp_path) == []
  (tmp_path / 'empty').mkdir()  # an existing empty directory is taken
  out = export.write_hf_directory(str(tmp_path / 'empty'), {'model_type': 'x'}, state)
  assert sorted(os.listdir(out)) == ['config.json', 'model.safetensors']
  np.testing.assert_array_equal(
      safetensors_numpy.load_file(os.path.join(out, 'model.safetensors'))['w'], state['w'])
  with pytest.raises(ConfigError, match='exists and is not an empty directory'):
    export.write_hf_directory(out, {}, state)
  (tmp_path / 'file').write_text('x')
  with pytest.raises(ConfigError, match='exists and is not an empty directory'):
    export.write_hf_directory(str(tmp_path / 'file'), {}, state)
  assert sorted(os.listdir(tmp_path)) == ['empty', 'file']


# -- converters -----------------------------------------------------------------------------------


def _gpt2_params(cfg, seed=0):
  from transformer_jax.models.gpt import GPT
  return _random_params(GPT(cfg), jnp.zeros((1, 4), jnp.int32), seed=seed)


def test_gpt2_export_refuses_what_gpt2_cannot_express():
  from transformer_jax.models.gpt import gpt2_config, llama_config
  cases = {
      "position='rotary' (it needs 'learned')": llama_config(),
      "use_bias=False (it needs True)": gpt2_config(use_bias=False),
      "norm_position='post' (it needs 'pre')": gpt2_config(norm_position='post'),
      "activation='swiglu'": gpt2_config(activation='swiglu'),
      'num_kv_heads=4 (it needs 12)': gpt2_config(num_kv_heads=4),
  }
  for message, cfg in cases.items():
    with pytest.raises(
        ConfigError,
        match=r'^GPT-2 cannot express ' + message.replace('(', r'\(').replace(')', r'\)')):
      hf_gpt2.gpt2_config_to_hf(cfg)
  cfg = gpt2_config(vocab_size=40, emb_dim=16, num_heads=2, mlp_dim=32, num_decoder_layers=2,
                    max_len=8)
  params = _gpt2_params(cfg)
  with pytest.raises(ConfigError, match=r'params have stack/layer_1/.*no place for'):
    hf_gpt2.export_gpt2_state_dict(cfg.replace(num_decoder_layers=1), params)
  with pytest.raises(ConfigError, match=r'wpe.weight has shape \(8, 16\) but the config implies'):
    hf_gpt2.export_gpt2_state_dict(cfg.replace(max_len=9), params)


@pytest.mark.parity
@pytest.mark.parametrize('tie_output,activation,scan_layers', [(False, 'gelu_exact', False),
                                                               (True, 'gelu', True)])
def test_gpt2_export_variants_match_transformers(tmp_path, tie_output, activation, scan_layers):
  transformers = _transformers()
  import torch
  from transformer_jax.layers.scan_layout import stack_layers, unstack_layers
  from transformer_jax.models.gpt import GPT, gpt2_config
  cfg = gpt2_config(vocab_size=61, emb_dim=32, num_heads=4, mlp_dim=48, num_decoder_layers=2,
                    max_len=24, tie_output=tie_output, activation=activation)
  params = _gpt2_params(cfg)
  run_cfg, run_params = cfg, params
  if scan_layers:  # trained with nn.scan: params stacked under 'layers'
    run_cfg, run_params = cfg.replace(scan_layers=True), stack_layers(params)
  out = export.write_hf_directory(str(tmp_path / 'hf'), hf_gpt2.gpt2_config_to_hf(run_cfg),
                                  hf_gpt2.export_gpt2_state_dict(run_cfg, run_params))
  model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys'], info
  tokens = np.random.default_rng(1).integers(0, 61, (2, 24), dtype=np.int32)
  ours = np.asarray(GPT(run_cfg).apply({'params': run_params}, jnp.asarray(tokens)))
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
  difference = float(np.abs(ours - theirs).max())
  print(f'GPT-2 tie_output={tie_output} {activation} scan={scan_layers}: max |difference| = '
        f'{difference:.3g}')
  assert np.abs(theirs).max() > 0.5 and difference <= TOLERANCE
  imported_model = hf_gpt2.load(out)
  imported_cfg, imported = imported_model.config, imported_model.params
  assert imported_cfg == cfg  # every switch (dropout, epsilon, init std) comes back
  _assert_bitwise_equal(imported, unstack_layers(run_params))


BERT_HEADS = {
    'BertForPreTraining': dict(mlm=True, sentence_classes=2),
    'BertForMaskedLM': dict(mlm=True, sentence_classes=0),
    'BertForSequenceClassification': dict(mlm=False, sentence_classes=0, num_labels=3),
    'BertModel': dict(mlm=False, sentence_classes=0),
}


@pytest.mark.parity
@pytest.mark.parametrize('architecture', sorted(BERT_HEADS))
def test_bert_export_heads_match_transformers(tmp_path, architecture):
  transformers = _transformers()
  import torch
  from transformer_jax.models.bert import Bert, bert_config
  cfg = bert_config(vocab_size=53, emb_dim=32, num_heads=4, mlp_dim=48, num_encoder_layers=2,
                    max_len=20, activation='gelu_exact')
  bert = Bert(cfg, **BERT_HEADS[architecture])
  tokens = np.random.default_rng(2).integers(5, 53, (2, 12)).astype(np.int32)
  tokens[1, 7:] = 0  # padding
  types = np.zeros_like(tokens)
  types[:, 4:] = 1
  positions = np.asarray([[1, 4, 6], [0, 2, 5]], np.int32)
  params = _random_params(bert, jnp.asarray(tokens), mlm_positions=positions, seed=3, std=0.2)
  heads = hf_bert.bert_heads(params)
  hf_config = hf_bert.bert_config_to_hf(cfg, **heads)
  assert hf_config['architectures'] == [architecture]
  out = export.write_hf_directory(str(tmp_path / 'hf'), hf_config,
                                  hf_bert.export_bert_state_dict(cfg, params))
  model, info = getattr(transformers, architecture).from_pretrained(out, output_loading_info=True)
  assert not info['missing_keys'], info
  # BertForMaskedLM has no pooler: ours (kept, for a round trip and for fine-tuning) is unused.
  assert all(k.startswith('bert.pooler.') for k in info['unexpected_keys']), info
  valid = tokens != 0
  ours = bert.apply({'params': params}, tokens, types, mlm_positions=positions)
  with torch.no_grad():
    theirs = model(input_ids=torch.from_numpy(tokens).long(),
                   token_type_ids=torch.from_numpy(types).long(),
                   attention_mask=torch.from_numpy(valid.astype(np.int64)))
  pairs = {
      'BertForPreTraining': [('mlm_logits', 'prediction_logits'),
                             ('sentence_logits', 'seq_relationship_logits')],
      'BertForMaskedLM': [('mlm_logits', 'logits')],
      'BertForSequenceClassification': [('class_logits', 'logits')],
      'BertModel': [('pooled', 'pooler_output'), ('hidden', 'last_hidden_state')],
  }[architecture]
  for name, hf_name in pairs:
    expected = getattr(theirs, hf_name).numpy()
    got = np.asarray(ours[name])
    if name == 'mlm_logits':
      expected = np.take_along_axis(expected, positions[..., None], axis=1)
    if name == 'hidden':
      got, expected = got[valid], expected[valid]  # padded positions differ by design
    difference = float(np.abs(got - expected).max())
    print(f'{architecture} {name}: max |difference| = {difference:.3g}')
    assert np.abs(expected).max() > 0.1 and difference <= TOLERANCE, name
  _, imported, heads_back = _import_bert(out)
  assert heads_back == heads
  _assert_bitwise_equal(imported, params)


def _import_bert(directory):
  """`hf_bert.load` without vocab.txt: (cfg, params, heads)."""
  with open(os.path.join(directory, 'config.json')) as f:
    cfg, type_vocab_size = hf_bert.bert_config_from_hf(json.load(f))
  state = hf_gpt2.read_state_dict(directory)
  heads = hf_bert.detect_heads(state)
  params = hf_bert.convert_bert_state_dict(state, cfg, type_vocab_size, heads)
  return cfg, params, dict(heads, type_vocab_size=type_vocab_size)


def test_bert_export_refuses_what_bert_cannot_express():
  from transformer_jax.models.bert import bert_config
  with pytest.raises(ConfigError, match=r"^BERT cannot express norm_position='pre'"):
    hf_bert.bert_config_to_hf(bert_config(norm_position='pre'))
  with pytest.raises(ConfigError, match=r"^BERT cannot express position='relative'"):
    hf_bert.bert_config_to_hf(bert_config(position='relative'))
  with pytest.raises(ConfigError, match='no Hugging Face BERT class holds the heads mlm=True'):
    hf_bert.bert_config_to_hf(bert_config(), mlm=True, sentence_classes=0, num_labels=2)


# -- tokenizers -----------------------------------------------------------------------------------

LINES = [
    'ROMEO: But soft, what light through yonder window breaks?',
    '  two  spaces, then\nnewlines\n\nand\ttabs ',
    'Héllo wörld — ünïcode and unseen ~~ symbols 123',
    ' lead and trail ',
]


@pytest.mark.parity
@pytest.mark.parametrize('model_type', ['unigram', 'bpe'])
def test_sentencepiece_tokenizer_files_give_the_same_ids(tmp_path, tiny_shakespeare, model_type):
  transformers = _transformers()
  from transformer_jax.data.tokenizer import train_tokenizer
  with open(tiny_shakespeare, encoding='utf-8') as f:
    lines = f.read().splitlines()[:3000]
  tokenizer = train_tokenizer(lines, str(tmp_path / 'spm.model'), 300, model_type=model_type)
  files = export.sentencepiece_tokenizer_files(tokenizer, 64)
  assert files.vocab_size == 300
  assert files.special_ids == {'pad_token_id': 0, 'eos_token_id': 1, 'bos_token_id': 2}
  (tmp_path / 'hf').mkdir()
  files.write(str(tmp_path / 'hf'))
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
  assert (hf_tokenizer.pad_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.bos_token_id,
          hf_tokenizer.unk_token_id) == (0, 1, 2, 3)
  for line in LINES + lines[3:40]:
    ids = tokenizer.encode(line)
    assert hf_tokenizer.encode(line, add_special_tokens=False) == ids, line
  assert hf_tokenizer.decode(tokenizer.encode(LINES[0])) == tokenizer.decode(
      tokenizer.encode(LINES[0]))


@pytest.mark.parity
@pytest.mark.parametrize('lowercase', [True, False])
def test_wordpiece_tokenizer_files_keep_ids_and_case(tmp_path, lowercase):
  transformers = _transformers()
  from transformer_jax.data.wordpiece import WordPieceTokenizer
  texts = ['The Cat sat on the Mat', 'the cat ran', 'Dogs and CATS and birds'] * 20
  tokenizer = WordPieceTokenizer.train(texts, 80, lowercase=lowercase)
  files = export.wordpiece_tokenizer_files(tokenizer, 32)
  files.write(str(tmp_path))
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for text in ('The Cat sat', 'DOGS and unseen Wörds!', 'cats'):
    assert hf_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text), text
  ids, segments = tokenizer.encode_pair('The Cat', 'the Mat')
  encoded = hf_tokenizer('The Cat', 'the Mat')
  assert encoded['input_ids'] == ids and encoded['token_type_ids'] == segments
  # The cased vocabulary tells 'The' from 'the'; the uncased one does not.
  assert (tokenizer.encode('The') == tokenizer.encode('the')) == lowercase


@pytest.mark.parity
def test_char_tokenizer_files_give_the_same_ids(tmp_path):
  transformers = _transformers()
  from transformer_jax.data.lm import CharTokenizer
  text = ''.join(LINES)
  tokenizer = CharTokenizer.from_text(text)
  export.char_tokenizer_files(tokenizer, 16).write(str(tmp_path))
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert len(hf_tokenizer) == tokenizer.vocab_size
  for line in LINES + ['\n', ' ', '  \n ']:
    assert hf_tokenizer.encode(line, add_special_tokens=False) == tokenizer.encode(line), line
    assert hf_tokenizer.decode(tokenizer.encode(line)) == line


@pytest.mark.parity
def test_byte_level_bpe_tokenizer_files_give_the_same_ids(tmp_path):
  transformers = _transformers()
  from transformer_jax.data.hf_tokenizer import HFTokenizer
  tokenizer = HFTokenizer.train_byte_level_bpe(LINES * 30, 300)
  files = export.hf_tokenizer_files(tokenizer)
  files.write(str(tmp_path))
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for line in LINES:
    assert hf_tokenizer.encode(line, add_special_tokens=False) == tokenizer.encode(line), line
  assert files.special_ids.get('eos_token_id') == tokenizer.eos_id


@pytest.mark.parametrize('family', ['gpt2', 'llama', 't5', 'bert'])
@pytest.mark.parametrize('switch', [dict(share_layers=True), dict(embedding_size=16)])
def test_albert_switches_are_refused_by_the_other_families(family, switch):
  """ALBERT's shared layers and factorised embedding have no equivalent in the other HF
  families: their exporters name the switch instead of failing later on a missing tensor."""
  from transformer_jax.convert import hf_llama, hf_t5
  from transformer_jax.models import bert_config, gpt2_config, llama_config, t5_config
  preset, to_hf = {
      'gpt2': (gpt2_config, hf_gpt2.gpt2_config_to_hf),
      'llama': (llama_config, hf_llama.llama_config_to_hf),
      't5': (t5_config, hf_t5.t5_config_to_hf),
      'bert': (bert_config, hf_bert.bert_config_to_hf),
  }[family]
  name = next(iter(switch))
  with pytest.raises(ConfigError, match=name):
    to_hf(preset(**switch))
