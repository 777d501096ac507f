"""`experiments.lm --config.init.hf_dir=DIR`: continued pretraining of an imported Hugging Face
causal LM (workflows/lm_init.py), for every causal family of the registry.

The reference is a tiny random transformers model (perturbed weights) saved with a tokenizer
trained here (a byte-level BPE; LLaMA's a SentencePiece tokenizer.model), so nothing is
downloaded. The run starts from gpt2_shakespeare_bpe.py, whose model section (GPT-2's blocks,
128 wide) the import replaces. Proven: the planner sees the imported model; the loss of the first
step, logged before the first update, equals transformers' loss on the same batch (so every
parameter and every id is the import's); the loss falls; the plain command resumes without the
folder; the workdir restores, scores a file and exports to a folder that transformers loads and
that computes what the workdir computes. Needs the `parity` extra (torch, transformers).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_lm_evaluate import _one_error_line

pytestmark = [pytest.mark.parity, pytest.mark.slow]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 360  # SentencePiece needs every character of DOCUMENTS and the 256 bytes
CONTEXT = 32  # the imported models' positions
# Documents separated by blank lines (how a 'file' source is cut for a subword tokenizer).
DOCUMENTS = [
    'The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day.',
    'A café in Zürich serves crème brûlée; naïve visitors pay four euros for it.',
    'ROMEO: But soft, what light through yonder window breaks? It is the east.',
    'JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father.',
] * 6
STEPS = 12
TINY = {
    'data.block_size': 16, 'data.batch_size': 8, 'data.eval_batches': 1, 'data.train_fraction': 0.8,
    'optimizer.learning_rate': 1e-2, 'optimizer.end_learning_rate': 1e-3,
    'optimizer.warmup_steps': 1, 'optimizer.decay_steps': STEPS, 'train.num_steps': STEPS,
    'train.log_every': 1, 'train.eval_every': 0, 'train.checkpoint_every': 0,
    'train.eval_max_batches': 1, 'eval.sample_tokens': 0
}


def _transformers():
  torch = pytest.importorskip('torch', reason='needs the parity extra: pip install -e ".[parity]"')
  transformers = pytest.importorskip('transformers',
                                     reason='needs the parity extra: pip install -e ".[parity]"')
  return torch, transformers


def _tokenizer(directory, family: str):
  """The tokenizer saved in `directory`: LLaMA's kind (a SentencePiece tokenizer.model, BOS 1 and
  EOS 2), else GPT-2's (a byte-level BPE, '<|endoftext|>' both)."""
  from transformer_jax.data.hf_tokenizer import HFTokenizer
  if family != 'llama':
    tokenizer = HFTokenizer.train_byte_level_bpe(DOCUMENTS, VOCAB)
    tokenizer.save(str(directory))
    return tokenizer
  import io
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(DOCUMENTS), model_writer=model,
                                 vocab_size=VOCAB, model_type='bpe', byte_fallback=True,
                                 normalization_rule_name='identity', minloglevel=2)
  (directory / 'tokenizer.model').write_bytes(model.getvalue())
  return HFTokenizer.from_dir(str(directory))


def _hf_causal_lm(transformers, family: str, tokenizer):
  """A small random causal LM of `family` with a CONTEXT-token context and VOCAB ids."""
  common = dict(vocab_size=VOCAB, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
  if family == 'gpt2':
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=CONTEXT, **common))
  if family == 'llama':
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64,
                                 max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                                 **common))
  return transformers.OPTForCausalLM(
      transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                             max_position_embeddings=CONTEXT, dropout=0.0, attention_dropout=0.0,
                             pad_token_id=VOCAB - 1, **common))


def _hf_folder(directory, family: str):
  """(the folder of a tiny random `family` model and its tokenizer, the torch model, the
  tokenizer)."""
  torch, transformers = _transformers()
  directory.mkdir()
  tokenizer = _tokenizer(directory, family)
  torch.manual_seed(0)
  model = _hf_causal_lm(transformers, family, tokenizer)
  with torch.no_grad():  # HF starts biases at 0 and norms at 1: a mis-mapped one would hide
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.eval().save_pretrained(str(directory), safe_serialization=True)
  return str(directory), model, tokenizer


def _config(hf_dir: str, text_path: str):
  from experiments.configs import gpt2_shakespeare_bpe
  config = gpt2_shakespeare_bpe.get_config()
  config.data.path = text_path
  for key, value in TINY.items():
    section, leaf = key.split('.')
    config[section][leaf] = value
  config.init.hf_dir = hf_dir
  return config


def _torch_loss(torch, model, batch) -> float:
  """transformers' mean next-token NLL of `batch` ({'inputs', 'targets'})."""
  inputs = torch.tensor(np.asarray(batch['inputs'], np.int64))
  with torch.no_grad():
    logits = model(inputs, attention_mask=torch.ones_like(inputs)).logits
    return float(
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).double(),
            torch.tensor(np.asarray(batch['targets'], np.int64)).reshape(-1)))


def _losses(workdir: str) -> dict[int, float]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    records = [json.loads(line) for line in f]
  return {r['step']: r['train/loss'] for r in records if 'train/loss' in r}


@pytest.mark.parametrize('family', ['gpt2', 'llama', 'opt'])
def test_continued_pretraining_starts_from_the_import_and_exports(family, tmp_path):
  import jax
  torch, transformers = _transformers()
  from transformer_jax.cli.workdir import load_saved_config
  from transformer_jax.corpus.reader import PreparedCorpus
  from transformer_jax.data import lm as lm_data
  from transformer_jax.workflows import lm
  from transformer_jax.workflows.export import export_workdir
  hf_dir, model, tokenizer = _hf_folder(tmp_path / 'hf', family)
  text_path = tmp_path / 'train.txt'
  text_path.write_text('\n\n'.join(DOCUMENTS) + '\n', encoding='utf-8')
  workdir = str(tmp_path / 'work')
  # The planner sees the imported model from its config.json alone.
  planned, shapes = lm.abstract_task(_config(hf_dir, str(text_path)))
  assert (planned.cfg.emb_dim, planned.cfg.vocab_size, planned.cfg.max_len) == (32, VOCAB, CONTEXT)
  assert shapes['inputs'].shape == (TINY['data.batch_size'], TINY['data.block_size'])
  lm.train_and_evaluate(_config(hf_dir, str(text_path)), workdir)

  # The saved config is the import's model (with the run's dropout and dtypes) and tokenizer.
  saved = load_saved_config(workdir)
  assert (saved.model.emb_dim, saved.model.num_decoder_layers, saved.model.max_len,
          saved.model.vocab_size) == (32, 2, CONTEXT, VOCAB)
  assert saved.model.dropout_rate == 0.0 and saved.init.hf_dir == hf_dir
  assert (saved.tokenizer.type, saved.tokenizer.vocab_size) == ('hf', tokenizer.vocab_size)

  # Step 1's loss, taken before the first update, is transformers' on the same batch: every
  # parameter and every id is the import's.
  sections = lm.validate(saved)
  corpus = PreparedCorpus(os.path.join(workdir, lm.CORPUS_DIR))
  assert corpus.split('train').tokens(0, 8).tolist() == tokenizer.encode(DOCUMENTS[0])[:8]
  train, _ = lm.make_data(sections, corpus.split('train'), corpus.split('valid'), tokenizer.eos_id)
  first = train.batch(0)
  reference = _torch_loss(torch, model, first)
  losses = _losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  print(f'{family}: step-0 loss ours {losses[1]:.6f} transformers {reference:.6f}; step '
        f'{STEPS}: {losses[STEPS]:.4f}')
  assert losses[1] == pytest.approx(reference, rel=1e-5)
  assert np.mean([losses[s] for s in range(STEPS - 2, STEPS + 1)
                 ]) < 0.85 * np.mean([losses[s] for s in (1, 2, 3)])

  # The plain command resumes from the workdir's own checkpoint: the import is not read again.
  os.rename(hf_dir, f'{hf_dir}.moved')
  config = _config('', str(text_path))
  config.train.num_steps = STEPS + 2
  lm.train_and_evaluate(config, workdir)
  assert sorted(_losses(workdir)) == list(range(1, STEPS + 3))
  assert load_saved_config(workdir).model.to_dict() == saved.model.to_dict()

  # The other modes read the workdir like one trained from scratch: restore (the loss of the
  # first batch has fallen), evaluate a file, export to a folder transformers loads.
  restored = lm.restore_for_inference(load_saved_config(workdir), workdir)
  batch = {k: jax.numpy.asarray(v) for k, v in first.items()}
  trained, _ = restored.task.loss_fn(restored.params, batch, None, deterministic=True)
  assert float(trained) < 0.85 * reference
  scored = lm.evaluate_file(restored.task, restored.params, restored.tokenizer, str(text_path))
  assert scored['tokens'] > CONTEXT and scored['loss'] < reference
  out = str(tmp_path / 'exported')
  export_workdir(workdir, out)
  exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert _torch_loss(torch, exported, first) == pytest.approx(float(trained), rel=1e-4)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tokenizer.encode(DOCUMENTS[1],
                             add_special_tokens=False) == tokenizer.encode(DOCUMENTS[1])
  assert hf_tokenizer.eos_token_id == lm_data.lm_eos_id(restored.tokenizer) == tokenizer.eos_id


def _cli(*flags) -> subprocess.CompletedProcess:
  env = dict(os.environ, TRANSFORMER_JAX_ALLOCATOR='system', JAX_PLATFORMS='cpu',
             TF_CPP_MIN_LOG_LEVEL='2')
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [REPO_ROOT, env.get('PYTHONPATH')]))
  return subprocess.run([sys.executable, '-m', 'experiments.lm', *flags], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)


def test_init_errors_are_one_line_before_anything_is_written(tmp_path):
  from transformer_jax.errors import ConfigError
  from transformer_jax.workflows import lm
  text_path = tmp_path / 'train.txt'
  text_path.write_text('\n\n'.join(DOCUMENTS) + '\n', encoding='utf-8')
  bert = tmp_path / 'bert'  # an encoder: refused by config.json's model_type alone
  bert.mkdir()
  (bert / 'config.json').write_text(json.dumps({'model_type': 'bert'}))
  command = [
      '--config=experiments/configs/gpt2_shakespeare_bpe.py', f'--config.data.path={text_path}'
  ]
  line = _one_error_line(
      _cli(*command, f'--config.init.hf_dir={bert}', f'--workdir={tmp_path / "w1"}'))
  assert f"init.hf_dir {bert} has model_type='bert'" in line and 'gpt2, llama, opt' in line
  line = _one_error_line(
      _cli(*command, f'--config.init.hf_dir={tmp_path / "none"}', f'--workdir={tmp_path / "w2"}'))
  assert f'init.hf_dir {tmp_path / "none"} does not exist' in line
  assert not os.listdir(tmp_path / 'w1') and not os.listdir(tmp_path / 'w2')

  hf_dir, _, _ = _hf_folder(tmp_path / 'hf', 'gpt2')
  bare = tmp_path / 'no_tokenizer'  # the model alone
  bare.mkdir()
  for name in ('config.json', 'model.safetensors'):
    os.link(os.path.join(hf_dir, name), bare / name)
  cases = [
      ({'data.block_size': CONTEXT + 1}, hf_dir, f'data.block_size={CONTEXT + 1} is longer than '
       f'the context of the model in init.hf_dir ({CONTEXT} positions)'),
      ({'data.source': 'prepared',
        'data.prepared': str(tmp_path)}, hf_dir, "use data.source='file' or 'tfds'"),
      ({}, str(bare), f'init.hf_dir: {bare} holds no tokenizer.json'),
  ]
  for overrides, directory, message in cases:
    config = _config(directory, str(text_path))
    for key, value in overrides.items():
      section, leaf = key.split('.')
      config[section][leaf] = value
    with pytest.raises(ConfigError) as error:
      lm.train_and_evaluate(config, str(tmp_path / 'w3'))
    assert message in str(error.value) and '\n' not in str(error.value)
    assert not os.path.exists(tmp_path / 'w3')
