"""Imported Hugging Face RoBERTa weights compute what transformers' PyTorch RoBERTa computes.

Small random RobertaModel / RobertaForMaskedLM / RobertaForSequenceClassification (weights
perturbed from HF's init, fp32) are saved to tmp_path with a byte-level BPE trained here and
saved by transformers' RobertaTokenizerFast; their hidden states, pooled vectors, MLM and class
logits must equal ours to <= 1e-4 on a padded batch, the export must load back in transformers
with the same outputs, and import(export(params)) must be bitwise. Needs the `parity` extra.
"""

import json
import os

import flax
import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
transformers = pytest.importorskip('transformers',
                                   reason='needs the parity extra: pip install -e ".[parity]"')
safetensors_numpy = pytest.importorskip('safetensors.numpy')

from transformer_jax.convert import hf_bert, hf_roberta
from transformer_jax.data.roberta_tokenizer import RobertaTokenizer
from transformer_jax.errors import ConfigError
from transformer_jax.models.bert import Bert

pytestmark = pytest.mark.parity

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=40, type_vocab_size=1, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, layer_norm_eps=1e-5, hidden_act='gelu')
TEXTS = [
    'The quick brown fox jumps over the lazy dog, and the dog sleeps on.',
    'A short one.',
    'Hello world!',
]
CORPUS = [
    'the quick brown fox jumps over the lazy dog', 'a dog and a fox sleep in the sun',
    'hello world, hello sun, hello quick fox', 'short sentences make a small vocabulary'
] * 30
MAX_ABS = {}  # figures measured by the tests, printed with -s


def _perturbed(model):
  # HF initialises biases to 0 and norms to 1, which would hide a mis-mapped bias or norm.
  torch.manual_seed(1)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope='module')
def tokenizer_dir(tmp_path_factory):
  """A byte-level BPE (RoBERTa's special tokens first) saved by RobertaTokenizerFast."""
  directory = tmp_path_factory.mktemp('roberta_tokenizer')
  roberta_tokenizer(CORPUS, 330,
                    tmp_path_factory.mktemp('bpe_files')).save_pretrained(str(directory))
  return str(directory)


def roberta_tokenizer(corpus, vocab_size: int, scratch):
  """transformers' RobertaTokenizerFast over a byte-level BPE learned from `corpus`, RoBERTa's
  special tokens first (<pad> = 1); `scratch`: a folder for the BPE files."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  backend = Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.train_from_iterator(
      corpus,
      trainers.BpeTrainer(vocab_size=vocab_size,
                          special_tokens=['<s>', '<pad>', '</s>', '<unk>', '<mask>'],
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                          show_progress=False))
  backend.model.save(str(scratch))
  return transformers.RobertaTokenizerFast.from_pretrained(str(scratch))


def _save_model(model, tokenizer_dir, directory):
  model.save_pretrained(str(directory), safe_serialization=True)
  transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(str(directory))
  return str(directory)


def _hf_config(tokenizer_dir, **overrides):
  vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
  return transformers.RobertaConfig(**SMALL, vocab_size=vocab, **overrides)


@pytest.fixture(scope='module')
def mlm_dir(tokenizer_dir, tmp_path_factory):
  model = _perturbed(transformers.RobertaForMaskedLM(_hf_config(tokenizer_dir)))
  return model, _save_model(model, tokenizer_dir, tmp_path_factory.mktemp('roberta_mlm'))


def _hf_batch(directory):
  """HF's padded batch (pad id 1) of TEXTS: (input_ids, attention_mask) as numpy."""
  batch = transformers.AutoTokenizer.from_pretrained(directory)(TEXTS, padding=True)
  ids = np.asarray(batch['input_ids'], np.int32)
  valid = np.asarray(batch['attention_mask'], bool)
  assert (~valid).any() and (ids[~valid] == 1).all()  # padded, with RoBERTa's <pad>
  return ids, valid


def _torch(model, ids, valid):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(ids).long(),
                 attention_mask=torch.from_numpy(valid.astype(np.int64)))


def _max_diff(ours, theirs, valid=None):
  diff = np.abs(np.asarray(ours) - np.asarray(theirs))
  return float((diff[valid] if valid is not None else diff).max())


def test_tokenizer_ids_match_transformers(mlm_dir):
  _, directory = mlm_dir
  tokenizer = hf_roberta.load(directory).tokenizer
  reference = transformers.AutoTokenizer.from_pretrained(directory)
  assert (tokenizer.hf_pad_id, tokenizer.pad_id) == (1, 0)
  assert tokenizer.to_hf([tokenizer.cls_id, tokenizer.sep_id]) == [0, 2]
  assert tokenizer.to_hf([tokenizer.mask_id]) == [reference.mask_token_id]
  for text in TEXTS:
    ids, segments = tokenizer.encode_pair(text)
    assert tokenizer.to_hf(ids) == reference(text)['input_ids'] and set(segments) == {0}
    assert tokenizer.decode(ids) == f'<s>{text}</s>'
  pair, _ = tokenizer.encode_pair(TEXTS[1], TEXTS[2])
  assert tokenizer.to_hf(pair) == reference(TEXTS[1], TEXTS[2])['input_ids']
  assert len(tokenizer.encode_pair(TEXTS[0], None, max_len=8)[0]) == 8


def test_tokenizer_from_bare_vocab_and_merges(mlm_dir, tmp_path):
  _, directory = mlm_dir
  reference = transformers.AutoTokenizer.from_pretrained(directory)
  reference.backend_tokenizer.model.save(str(tmp_path))  # vocab.json + merges.txt only
  assert sorted(os.listdir(tmp_path)) == ['merges.txt', 'vocab.json']
  tokenizer = RobertaTokenizer.from_dir(str(tmp_path))
  assert tokenizer.vocab_size == len(reference) and tokenizer.hf_pad_id == 1
  for text in TEXTS:
    assert tokenizer.to_hf(tokenizer.encode_pair(text)[0]) == reference(text)['input_ids']


def test_masked_lm_matches_transformers(mlm_dir):
  model, directory = mlm_dir
  imported_model = hf_roberta.load(directory)
  cfg, params = imported_model.config, imported_model.params
  tokenizer, heads = imported_model.tokenizer, imported_model.heads
  assert heads == {'mlm': True, 'sentence_classes': 0, 'num_labels': 0, 'type_vocab_size': 1}
  assert (cfg.max_len, cfg.norm_epsilon, cfg.activation) == (38, 1e-5, 'gelu_exact')
  assert 'pooler' not in params
  hf_ids, valid = _hf_batch(directory)
  tokens = tokenizer.from_hf(hf_ids)
  assert (tokens[~valid] == 0).all() and (tokens[:, 0] == tokenizer.cls_id).all()
  positions = np.array([[1, 3, 7], [0, 2, 4], [1, 2, 3]], np.int32)
  assert np.take_along_axis(valid, positions, axis=1).all()
  bert = Bert(cfg, **heads)
  init = bert.init(jax.random.key(0), tokens, mlm_positions=positions)
  pooler = flax.linen.meta.unbox(init['params'])['pooler']  # not in a ForMaskedLM checkpoint
  ours = bert.apply({'params': {**params, 'pooler': pooler}}, tokens, mlm_positions=positions)
  theirs = _torch(model.roberta, hf_ids, valid).last_hidden_state.numpy()
  assert np.abs(theirs).max() > 0.1
  MAX_ABS['hidden'] = _max_diff(ours['hidden'], theirs, valid)
  assert MAX_ABS['hidden'] <= 1e-4
  logits = _torch(model, hf_ids, valid).logits.numpy()
  # Ours are in our id space: column j is HF's column to_hf(j).
  order = tokenizer.to_hf(np.arange(cfg.vocab_size))
  expected = np.take_along_axis(logits, positions[..., None], axis=1)[..., order]
  MAX_ABS['mlm_logits'] = _max_diff(ours['mlm_logits'], expected)
  assert MAX_ABS['mlm_logits'] <= 1e-4


def _export(tmp_path, name, cfg, params, tokenizer):
  """Writes our params as an HF directory the way experiments.export does; returns its path."""
  heads = hf_bert.bert_heads(params)
  directory = tmp_path / name
  directory.mkdir()
  hf_config = hf_roberta.roberta_config_to_hf(cfg, **heads,
                                              **{k: v for k, v in tokenizer.hf_special_ids.items()})
  (directory / 'config.json').write_text(json.dumps(hf_config))
  state = hf_roberta.export_roberta_state_dict(cfg, params, tokenizer.hf_pad_id)
  safetensors_numpy.save_file(state, str(directory / 'model.safetensors'),
                              metadata={'format': 'pt'})
  tokenizer.save(str(directory), max_len=cfg.max_len)
  return str(directory), state


def _assert_bitwise(a, b):
  flat_a, flat_b = (flax.traverse_util.flatten_dict(x) for x in (a, b))
  assert sorted(flat_a) == sorted(flat_b)
  for key, value in flat_a.items():
    assert value.dtype == flat_b[key].dtype and np.array_equal(value, flat_b[key]), key


def test_masked_lm_export_loads_back_in_transformers(mlm_dir, tmp_path):
  model, directory = mlm_dir
  imported_model = hf_roberta.load(directory)
  cfg, params = imported_model.config, imported_model.params
  tokenizer, heads = imported_model.tokenizer, imported_model.heads
  # Pretrained here, a Bert with an MLM head also has a pooler: written, and ignored by HF.
  init = Bert(cfg, **heads).init(jax.random.key(3), np.ones((1, 4), np.int32))
  params = dict(params, pooler=jax.device_get(flax.linen.meta.unbox(init['params'])['pooler']))
  out, state = _export(tmp_path, 'exported', cfg, params, tokenizer)
  assert 'roberta.pooler.dense.weight' in state
  np.testing.assert_array_equal(state['roberta.embeddings.position_embeddings.weight'][:2], 0)
  again = hf_roberta.convert_roberta_state_dict(state, cfg, 1, heads, tokenizer.hf_pad_id)
  _assert_bitwise(again, params)
  reloaded = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
  assert type(reloaded).__name__ == 'RobertaForMaskedLM'
  hf_ids, valid = _hf_batch(directory)
  assert transformers.AutoTokenizer.from_pretrained(out)(TEXTS, padding=True)['input_ids'] == \
      hf_ids.tolist()
  expected = _torch(model, hf_ids, valid).logits.numpy()
  MAX_ABS['export_mlm_logits'] = _max_diff(
      _torch(reloaded, hf_ids, valid).logits.numpy(), expected, valid)
  assert MAX_ABS['export_mlm_logits'] <= 1e-4
  # And our loader reads the exported directory (tokenizer files included) back unchanged.
  imported_model = hf_roberta.load(out)
  cfg2, params2 = imported_model.config, imported_model.params
  tokenizer2, heads2 = imported_model.tokenizer, imported_model.heads
  assert cfg2 == cfg and heads2 == heads and tokenizer2.vocab_size == tokenizer.vocab_size
  _assert_bitwise(params2, params)


@pytest.mark.parametrize('kind', ['model', 'classifier'])
def test_base_model_and_classifier(kind, tokenizer_dir, tmp_path):
  if kind == 'model':  # RobertaModel: hidden states and the pooler
    model = _perturbed(transformers.RobertaModel(_hf_config(tokenizer_dir)))
  else:  # classification head (dense + tanh + out_proj on <s>) = our pooler + classifier
    model = _perturbed(
        transformers.RobertaForSequenceClassification(_hf_config(tokenizer_dir, num_labels=3)))
  directory = _save_model(model, tokenizer_dir, tmp_path / 'hf')
  imported_model = hf_roberta.load(directory)
  cfg, params = imported_model.config, imported_model.params
  tokenizer, heads = imported_model.tokenizer, imported_model.heads
  assert heads['num_labels'] == (3 if kind == 'classifier' else 0) and not heads['mlm']
  hf_ids, valid = _hf_batch(directory)
  tokens = tokenizer.from_hf(hf_ids)
  ours = Bert(cfg, **heads).apply({'params': params}, tokens)
  theirs = _torch(model, hf_ids, valid)
  if kind == 'model':
    MAX_ABS['base_hidden'] = _max_diff(ours['hidden'], theirs.last_hidden_state.numpy(), valid)
    MAX_ABS['base_pooled'] = _max_diff(ours['pooled'], theirs.pooler_output.numpy())
    assert MAX_ABS['base_hidden'] <= 1e-4 and MAX_ABS['base_pooled'] <= 1e-4
  else:
    MAX_ABS['class_logits'] = _max_diff(ours['class_logits'], theirs.logits.numpy())
    assert MAX_ABS['class_logits'] <= 1e-4
  out, state = _export(tmp_path, 'exported', cfg, params, tokenizer)
  _assert_bitwise(hf_roberta.convert_roberta_state_dict(state, cfg, 1, heads, 1), params)
  auto = transformers.AutoModel if kind == 'model' else \
      transformers.AutoModelForSequenceClassification
  reloaded = auto.from_pretrained(out).eval()
  again = _torch(reloaded, hf_ids, valid)
  if kind == 'model':
    np.testing.assert_allclose(again.pooler_output.numpy(), theirs.pooler_output.numpy(), rtol=0,
                               atol=1e-5)
  else:
    np.testing.assert_allclose(again.logits.numpy(), theirs.logits.numpy(), rtol=0, atol=1e-5)
  print('max abs differences:', MAX_ABS)


# -- bad input ------------------------------------------------------------------------------------


def _copy_with_state(directory, target, state):
  target.mkdir()
  for name in os.listdir(directory):
    if name != 'model.safetensors':
      (target / name).write_bytes(open(os.path.join(directory, name), 'rb').read())
  safetensors_numpy.save_file(state, str(target / 'model.safetensors'), metadata={'format': 'pt'})
  return str(target)


def test_bad_checkpoints_are_one_named_line(mlm_dir, tmp_path):
  _, directory = mlm_dir
  state = safetensors_numpy.load_file(os.path.join(directory, 'model.safetensors'))

  def error(target_state, name):
    with pytest.raises(ConfigError) as info:
      hf_roberta.load(_copy_with_state(directory, tmp_path / name, target_state))
    assert '\n' not in str(info.value)
    return str(info.value)

  missing = {k: v for k, v in state.items() if k != 'roberta.encoder.layer.1.output.dense.weight'}
  assert 'lacks parameter(s) encoder.layer.1.output.dense.weight' in error(missing, 'missing')
  bad = dict(state, **{'roberta.embeddings.position_embeddings.weight': np.zeros((38, 64))})
  assert error(bad, 'positions') == ('roberta.embeddings.position_embeddings.weight has shape '
                                     '(38, 64) but the config implies (40, 64)')
  bad = dict(state, **{'lm_head.dense.weight': np.zeros((64, 32), np.float32)})
  assert error(bad, 'shape') == 'lm_head.dense.weight has shape (64, 32) but the config implies ' \
      '(64, 64)'
  untied = dict(state, **{'lm_head.decoder.weight': state['lm_head.dense.weight'][:1]})
  assert 'untied' in error(untied, 'untied')


def test_bert_and_roberta_directories_are_told_apart(mlm_dir, tmp_path):
  _, roberta_dir = mlm_dir
  with pytest.raises(
      ConfigError, match=r"model_type='roberta': a roberta checkpoint, not BERT; import it with "
      r'convert.families.of_directory\(DIR\).load\(DIR\)$'):
    hf_bert.load(roberta_dir)
  bert_dir = tmp_path / 'bert'
  bert_dir.mkdir()
  transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=64).to_json_file(str(bert_dir / 'config.json'))
  with pytest.raises(
      ConfigError, match=r"model_type='bert': a bert checkpoint, not RoBERTa; "
      r'import it with convert.families.of_directory\(DIR\).load\(DIR\)$'):
    hf_roberta.load(str(bert_dir))


def test_heads_roberta_cannot_hold_are_refused(mlm_dir):
  _, directory = mlm_dir
  imported_model = hf_roberta.load(directory)
  cfg, params = imported_model.config, imported_model.params
  with_nsp = dict(params, sentence_head={'kernel': np.zeros((64, 2)), 'bias': np.zeros(2)})
  with pytest.raises(ConfigError, match='no next-sentence / sentence-order head'):
    hf_roberta.export_roberta_state_dict(cfg, with_nsp)
  with pytest.raises(ConfigError, match="cannot express activation='relu'"):
    hf_roberta.roberta_config_to_hf(cfg.replace(activation='relu'))
  with pytest.raises(ConfigError, match="cannot express norm_position='pre'"):
    hf_roberta.roberta_config_to_hf(cfg.replace(norm_position='pre'), mlm=False)
