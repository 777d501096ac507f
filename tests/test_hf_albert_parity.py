"""Imported Hugging Face ALBERT weights give transformers' outputs, and export goes back.

Needs the `parity` extra (torch, transformers, safetensors). Small random AlbertModel,
AlbertForMaskedLM and AlbertForPreTraining (E=16 < D=32, one layer shared by 3, weights perturbed
from their init) saved to tmp_path: hidden states, pooled vectors, MLM and SOP logits equal
transformers' to max |difference| <= 1e-4 in float32; an export loads back in transformers with
the same outputs; import(export(params)) is bitwise. Bad checkpoints give one ConfigError line.
"""

import json
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')
safetensors_numpy = pytest.importorskip('safetensors.numpy')

from conftest import REPO_ROOT

from transformer_jax.convert import hf_albert, hf_bert
from transformer_jax.convert.export import write_hf_directory
from transformer_jax.errors import ConfigError
from transformer_jax.models.bert import Bert

pytestmark = pytest.mark.parity

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3,
             num_attention_heads=4, intermediate_size=64, max_position_embeddings=24,
             type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             classifier_dropout_prob=0.0, layer_norm_eps=1e-12, hidden_act='gelu_new')
TOL = 1e-4
POSITIONS = np.array([[1, 3, 7], [0, 2, 9], [1, 2, 4]], np.int32)


def _perturbed(model):
  # HF initialises biases to 0 and norms to 1, which would hide a mis-mapped bias or norm.
  torch.manual_seed(1)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def _save(model, directory):
  model.save_pretrained(str(directory), safe_serialization=True)
  return str(directory)


def _inputs(batch=3, length=14, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(5, VOCAB, (batch, length)).astype(np.int32)
  lengths = np.array([length, length // 2, 5])[:batch]
  valid = np.arange(length)[None] < lengths[:, None]
  segments = ((np.arange(length)[None] >= lengths[:, None] // 2) & valid).astype(np.int32)
  return np.where(valid, tokens, 0), segments, valid


def _torch_outputs(model, tokens, segments, valid):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens).long(),
                 token_type_ids=torch.from_numpy(segments).long(),
                 attention_mask=torch.from_numpy(valid.astype(np.int64)))


def _max_diff(ours, theirs, valid=None):
  diff = np.abs(np.asarray(ours) - np.asarray(theirs))
  return float((diff[valid] if valid is not None else diff).max())


def _gathered(logits):
  return np.take_along_axis(logits.numpy(), POSITIONS[..., None], axis=1)


@pytest.fixture(scope='module')
def pretraining(tmp_path_factory):
  """(model, directory) of a random small AlbertForPreTraining saved by HF."""
  model = _perturbed(transformers.AlbertForPreTraining(transformers.AlbertConfig(**SMALL)))
  return model, _save(model, tmp_path_factory.mktemp('albert_pretraining'))


def _our_outputs(cfg, params, heads, tokens, segments, positions=POSITIONS):
  return Bert(cfg, **heads).apply({'params': params}, tokens, segments, mlm_positions=positions)


def test_pretraining_checkpoint_matches_and_round_trips(pretraining, tmp_path):
  model, directory = pretraining
  imported_model = hf_albert.load(directory)
  cfg, params, heads = imported_model.config, imported_model.params, imported_model.heads
  assert heads == {'mlm': True, 'sentence_classes': 2, 'num_labels': 0, 'type_vocab_size': 2}
  assert (cfg.embedding_size, cfg.emb_dim, cfg.num_encoder_layers, cfg.share_layers,
          cfg.activation) == (16, 32, 3, True, 'gelu')
  # One shared layer, and exactly the tree our model initialises.
  assert list(params['encoder']) == ['shared_layer']
  init = jax.eval_shape(
      Bert(cfg, **heads).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32),
      mlm_positions=jnp.zeros((1, 2), jnp.int32))
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(params) == shapes(nn.meta.unbox(init['params']))

  tokens, segments, valid = _inputs()
  ours = _our_outputs(cfg, params, heads, tokens, segments)
  base = _torch_outputs(model.albert, tokens, segments, valid)
  full = _torch_outputs(model, tokens, segments, valid)
  assert np.abs(base.last_hidden_state.numpy()).max() > 0.1
  diffs = {
      'hidden': _max_diff(ours['hidden'], base.last_hidden_state.numpy(), valid),
      'pooled': _max_diff(ours['pooled'], base.pooler_output.numpy()),
      'mlm_logits': _max_diff(ours['mlm_logits'], _gathered(full.prediction_logits)),
      'sop_logits': _max_diff(ours['sentence_logits'], full.sop_logits.numpy()),
  }
  print('AlbertForPreTraining import, max |ours - transformers|:', diffs)
  assert max(diffs.values()) <= TOL, diffs

  # Export: bitwise inverse of the import, and transformers loads it with the same outputs.
  state = hf_albert.export_albert_state_dict(cfg, params)
  back = hf_albert.convert_albert_state_dict(state, cfg)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), back, params)
  out = write_hf_directory(str(tmp_path / 'exported'),
                           hf_albert.albert_config_to_hf(cfg, **hf_albert.albert_heads(params)),
                           state)
  assert transformers.AutoConfig.from_pretrained(out).architectures == ['AlbertForPreTraining']
  reloaded = transformers.AlbertForPreTraining.from_pretrained(out).eval()
  again = _torch_outputs(reloaded, tokens, segments, valid)
  exported = {
      'mlm_logits': _max_diff(again.prediction_logits.numpy(), full.prediction_logits.numpy()),
      'sop_logits': _max_diff(again.sop_logits.numpy(), full.sop_logits.numpy()),
  }
  print('exported AlbertForPreTraining reloaded, max |reloaded - original|:', exported)
  assert max(exported.values()) == 0.0, exported


def test_model_and_masked_lm_checkpoints(tmp_path):
  config = transformers.AlbertConfig(**SMALL)
  tokens, segments, valid = _inputs(seed=2)
  torch.manual_seed(0)
  encoder = _perturbed(transformers.AlbertModel(config))
  imported_model = hf_albert.load(_save(encoder, tmp_path / 'model'))
  cfg, params, heads = imported_model.config, imported_model.params, imported_model.heads
  assert heads == {'mlm': False, 'sentence_classes': 0, 'num_labels': 0, 'type_vocab_size': 2}
  ours = _our_outputs(cfg, params, heads, tokens, segments)
  theirs = _torch_outputs(encoder, tokens, segments, valid)
  hidden = _max_diff(ours['hidden'], theirs.last_hidden_state.numpy(), valid)
  pooled = _max_diff(ours['pooled'], theirs.pooler_output.numpy())

  torch.manual_seed(3)
  mlm_model = _perturbed(transformers.AlbertForMaskedLM(config))
  imported_model = hf_albert.load(_save(mlm_model, tmp_path / 'mlm'))
  cfg, mlm_params, heads = imported_model.config, imported_model.params, imported_model.heads
  assert heads['mlm'] and not heads['sentence_classes'] and 'pooler' not in mlm_params
  bert = Bert(cfg, **heads)
  # AlbertForMaskedLM has no pooler; give it any values (the MLM logits ignore it).
  pooler = nn.meta.unbox(bert.init(jax.random.key(0), tokens, segments,
                                   mlm_positions=POSITIONS))['params']['pooler']
  ours = bert.apply({'params': {**mlm_params, 'pooler': pooler}}, tokens, segments,
                    mlm_positions=POSITIONS)
  theirs = _torch_outputs(mlm_model, tokens, segments, valid)
  mlm = _max_diff(ours['mlm_logits'], _gathered(theirs.logits))
  mlm_hidden = _max_diff(
      ours['hidden'],
      _torch_outputs(mlm_model.albert, tokens, segments, valid).last_hidden_state.numpy(), valid)
  diffs = {
      'model hidden': hidden, 'model pooled': pooled, 'mlm hidden': mlm_hidden, 'mlm_logits': mlm
  }
  print('AlbertModel / AlbertForMaskedLM import, max |ours - transformers|:', diffs)
  assert max(diffs.values()) <= TOL, diffs

  for p, architecture, cls in ((params, 'AlbertModel', transformers.AlbertModel),
                               (mlm_params, 'AlbertForMaskedLM', transformers.AlbertForMaskedLM)):
    state = hf_albert.export_albert_state_dict(cfg, p)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True),
                 hf_albert.convert_albert_state_dict(state, cfg), p)
    out = write_hf_directory(str(tmp_path / f'export_{architecture}'),
                             hf_albert.albert_config_to_hf(cfg, **hf_albert.albert_heads(p)), state)
    reloaded = _torch_outputs(cls.from_pretrained(out).eval(), tokens, segments, valid)
    original = _torch_outputs(encoder if p is params else mlm_model, tokens, segments, valid)
    key = 'last_hidden_state' if p is params else 'logits'
    assert _max_diff(getattr(reloaded, key).numpy(), getattr(original, key).numpy()) == 0.0


def _copy_with_state(directory, tmp_path, state=None, config=None):
  """A copy of an HF directory with its weights and/or config.json replaced."""
  copy = tmp_path / 'edited'
  shutil.copytree(directory, copy)
  if state is not None:
    safetensors_numpy.save_file(state, str(copy / 'model.safetensors'), metadata={'format': 'pt'})
  if config is not None:
    (copy / 'config.json').write_text(json.dumps(config))
  return str(copy)


def _one_line_error(fn, *args, **kwargs) -> str:
  with pytest.raises(ConfigError) as info:
    fn(*args, **kwargs)
  message = str(info.value)
  assert '\n' not in message
  return message


def _state_and_config(directory):
  state = safetensors_numpy.load_file(os.path.join(directory, 'model.safetensors'))
  with open(os.path.join(directory, 'config.json')) as f:
    return state, json.load(f)


def test_bad_checkpoints_are_one_line_errors(pretraining, tmp_path):
  _, directory = pretraining
  state, config = _state_and_config(directory)
  cfg, _ = hf_albert.albert_config_from_hf(config)
  layer = 'albert.encoder.albert_layer_groups.0.albert_layers.0'

  missing = {k: v for k, v in state.items() if k != f'{layer}.ffn.weight'}
  message = _one_line_error(hf_albert.load, _copy_with_state(directory, tmp_path, missing))
  assert message == ('checkpoint lacks parameter(s) encoder.albert_layer_groups.0.albert_layers.0.'
                     'ffn.weight that the config implies')

  bad = dict(state)
  bad[f'{layer}.ffn.weight'] = np.zeros((50, 32), np.float32)
  assert _one_line_error(
      hf_albert.convert_albert_state_dict, bad,
      cfg) == (f'{layer}.ffn.weight has shape (50, 32) but the config implies (64, 32)')
  bad = dict(state, **{'albert.encoder.embedding_hidden_mapping_in.weight': np.zeros((32, 32))})
  assert 'embedding_hidden_mapping_in.weight has shape (32, 32)' in _one_line_error(
      hf_albert.convert_albert_state_dict, bad, cfg)

  # A second layer group is not one shared layer.
  extra = dict(
      state, **{
          'albert.encoder.albert_layer_groups.1.albert_layers.0.ffn.bias':
              np.zeros((64,), np.float32)
      })
  assert 'unknown parameter(s) albert.encoder.albert_layer_groups.1.' in _one_line_error(
      hf_albert.convert_albert_state_dict, extra, cfg)
  assert 'num_hidden_groups=2' in _one_line_error(hf_albert.albert_config_from_hf,
                                                  {**config, 'num_hidden_groups': 2})

  # The shared layer cannot fill an unshared config.
  assert _one_line_error(hf_albert.load, directory, share_layers=False) == (
      'an ALBERT checkpoint holds one layer shared by all 3 layers, but the config has '
      'share_layers=False (separate layers): keep share_layers=True')


def test_bert_and_albert_directories_are_not_confused(pretraining, tmp_path):
  _, albert_dir = pretraining
  message = _one_line_error(hf_bert.load, albert_dir)
  assert "model_type='albert'" in message
  bert = transformers.BertModel(
      transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=24))
  bert_dir = _save(bert, tmp_path / 'bert')
  message = _one_line_error(hf_albert.load, bert_dir)
  assert message == ("config.json has model_type='bert': a bert checkpoint, not ALBERT; import it "
                     'with convert.families.of_directory(DIR).load(DIR)')
  # A BERT state dict under an ALBERT config names what it lacks (not a shape error deep inside).
  state, _ = _state_and_config(bert_dir)
  cfg, _ = hf_albert.albert_config_from_hf({**SMALL, 'model_type': 'albert'})
  message = _one_line_error(hf_albert.convert_albert_state_dict, state, cfg)
  assert message.startswith('checkpoint has unknown parameter(s) encoder.layer.0.'), message


def test_export_refuses_what_albert_cannot_express(pretraining):
  _, directory = pretraining
  imported_model = hf_albert.load(directory)
  cfg, params = imported_model.config, imported_model.params
  assert 'share_layers=False' in _one_line_error(hf_albert.albert_config_to_hf,
                                                 cfg.replace(share_layers=False))
  assert 'embedding_size=None' in _one_line_error(hf_albert.export_albert_state_dict,
                                                  cfg.replace(embedding_size=None), params)
  assert "norm_position='pre'" in _one_line_error(hf_albert.albert_config_to_hf,
                                                  cfg.replace(norm_position='pre'))
  assert 'no Hugging Face ALBERT class' in _one_line_error(hf_albert.albert_config_to_hf, cfg,
                                                           mlm=False, sentence_classes=2)


def test_albert_directory_without_tokenizer_as_init_is_one_error_line_and_writes_nothing(
    pretraining, translate_cli, tmp_path):
  """The command line: fine-tuning from an ALBERT directory that holds no tokenizer.json (model
  files only) stops with one line saying so, exit status 1, and nothing in the workdir.
  tests/test_hf_encoder_uses.py fine-tunes from one that has it."""
  _, albert_dir = pretraining
  sst2 = tmp_path / 'sst2'
  sst2.mkdir()
  for split in ('train', 'dev'):
    (sst2 / f'{split}.tsv').write_text('label\tsentence\n1\ta fine film\n0\ta dull film\n')
  workdir = tmp_path / 'work'
  result = subprocess.run([
      sys.executable, '-m', 'experiments.bert',
      f'--config={os.path.join("experiments", "configs", "sst2_minilm.py")}',
      f'--workdir={workdir}', f'--config.init.hf_dir={albert_dir}', f'--config.data.dir={sst2}'
  ], cwd=REPO_ROOT, env=translate_cli.env(), capture_output=True, text=True, timeout=600,
                          check=False)
  errors = translate_cli.error_lines(result.stderr)
  assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
  assert 'has no tokenizer this albert import reads' in errors[0]
  assert 'Traceback' not in result.stderr
  # The workdir is made (and proven writable) first; nothing was written into it.
  assert not workdir.exists() or not any(workdir.iterdir())
