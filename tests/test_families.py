"""The registry of Hugging Face families (convert/families.py) is the one place that names them.

Every module that picks a family (import, export, `generate --hf_dir`, fill-mask, BERT and T5
fine-tuning) looks it up there; a family's name as a string, or an import of a family's converter
module, anywhere else in the library would be a second, silent dispatch that a new family does
not reach. Both are checked over the whole source, imports inside functions included.
"""

import ast
import json
import os
import pathlib
from types import ModuleType

import pytest

from conftest import REPO_ROOT
from test_import_layers import absolute_imports
from transformer_jax.convert import families
from transformer_jax.errors import ConfigError, DataError

# The registry and each family's own converter module may name families.
OWN_MODULES = {'transformer_jax/convert/families.py'
              } | {f.module.replace('.', '/') + '.py' for f in families.FAMILIES}


def library_files():
  root = pathlib.Path(REPO_ROOT)
  for folder in ('transformer_jax', 'experiments'):
    yield from sorted((root / folder).rglob('*.py'))


def test_no_module_but_the_registry_and_the_families_own_names_a_family():
  names = {n for f in families.FAMILIES for n in (f.name, *f.model_types)}
  found = []
  for path in library_files():
    relative = path.relative_to(REPO_ROOT).as_posix()
    if relative in OWN_MODULES:
      continue
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
      if isinstance(node, ast.Constant) and node.value in names:
        found.append(f'{relative}:{node.lineno}: {node.value!r}')
  assert not found, 'family names outside convert/families.py:\n' + '\n'.join(found)


CONVERTERS = {f.module for f in families.FAMILIES}


def converter_imports(path: pathlib.Path) -> list[str]:
  """'line: module[.name]' for each import in `path` that reaches a family's converter module:
  the module itself, or a name the convert package re-exports from one."""
  import transformer_jax.convert as package
  found = []
  for line, module, names in absolute_imports(path):
    if module in CONVERTERS or any(module.startswith(c + '.') for c in CONVERTERS):
      found.append(f'{line}: {module}')
    elif module == package.__name__:
      for name in names:
        value = getattr(package, name, None)
        origin = f'{package.__name__}.{name}' if isinstance(value, ModuleType) else getattr(
            value, '__module__', '')
        if origin in CONVERTERS:
          found.append(f'{line}: {module}.{name}')
  return found


def test_outside_convert_no_module_imports_a_family_converter():
  found = []
  for path in library_files():
    relative = path.relative_to(REPO_ROOT).as_posix()
    if not relative.startswith('transformer_jax/convert/'):
      found += [f'{relative}:{hit}' for hit in converter_imports(path)]
  assert not found, ('imports of a family converter outside convert/ (ask '
                     'convert.families instead):\n' + '\n'.join(found))


def test_the_converter_import_check_finds_every_spelling(tmp_path):
  source = tmp_path / 'module.py'
  source.write_text('import os\n'
                    'from transformer_jax.convert import families, write_hf_directory\n'
                    'def f():\n'
                    '  from transformer_jax.convert import hf_bert\n'
                    '  from transformer_jax.convert.hf_t5 import load\n'
                    '  import transformer_jax.convert.hf_gpt2\n'
                    '  from transformer_jax.convert import bert_config_to_hf\n')
  assert converter_imports(source) == [
      '4: transformer_jax.convert.hf_bert', '5: transformer_jax.convert.hf_t5',
      '6: transformer_jax.convert.hf_gpt2', '7: transformer_jax.convert.bert_config_to_hf'
  ]


def test_every_family_module_has_the_converter_interface():
  for family in families.FAMILIES:
    module = family.converter
    for name in ('load', 'exporters', 'claims', 'config_from_hf'):
      assert callable(getattr(module, name, None)), (family.name, name)
    to_hf, export_state_dict = family.exporters()
    assert callable(to_hf) and callable(export_state_dict)


def test_lookups_and_their_errors(tmp_path):
  assert families.named('llama').kind == families.CAUSAL_LM
  assert families.names(families.ENCODER) == ('bert', 'albert', 'roberta')
  with pytest.raises(ConfigError, match=r"unknown model family 'gpt5'; known: gpt2, llama"):
    families.named('gpt5')
  assert families.of_model_type('roberta').byte_level
  causal = ', '.join(families.names(families.CAUSAL_LM))
  assert causal.startswith('gpt2, llama')
  with pytest.raises(
      ConfigError, match=r"x/config.json has model_type='t5'; supported causal "
      f'language models: {causal}$'):
    families.of_model_type('t5', families.CAUSAL_LM, where='x/config.json')
  folder = tmp_path / 'model'
  folder.mkdir()
  (folder / 'config.json').write_text(json.dumps({}))
  # BERT's oldest folders name no model_type; a causal LM must name one.
  assert families.of_directory(str(folder)).name == 'bert'
  with pytest.raises(ConfigError, match='has no model_type'):
    families.of_directory(str(folder), families.CAUSAL_LM)
  with pytest.raises(DataError, match='config.json does not exist'):
    families.of_directory(str(tmp_path / 'nowhere'))
  assert os.path.basename(families.named('t5').module) == 'transformer_jax.convert.hf_t5'


def test_an_export_goes_to_the_family_that_claims_it():
  from transformer_jax.models.bert import albert_config, bert_config
  from transformer_jax.models.encoder_decoder import t5_config
  from transformer_jax.models.gpt import gpt2_config, llama_config, opt_config
  tiny = dict(vocab_size=64, emb_dim=32, num_heads=2, mlp_dim=64, max_len=32)
  assert families.exporting(families.CAUSAL_LM, gpt2_config(**tiny)).name == 'gpt2'
  assert families.exporting(families.CAUSAL_LM, llama_config(**tiny)).name == 'llama'
  # GPT-2 computes OPT's switches (GPT-2's with ReLU) too; a model built with them is an OPT. A
  # ReLU model at a norm epsilon OPT lacks stays GPT-2's, which has the field.
  assert families.exporting(families.CAUSAL_LM, opt_config(**tiny)).name == 'opt'
  assert families.exporting(families.CAUSAL_LM, gpt2_config(**tiny,
                                                            activation='relu')).name == 'opt'
  assert families.exporting(families.CAUSAL_LM, opt_config(**tiny,
                                                           norm_epsilon=1e-6)).name == 'gpt2'
  assert families.exporting(families.ENCODER, bert_config(**tiny)).name == 'bert'
  assert families.exporting(families.ENCODER, bert_config(**tiny),
                            byte_level=True).name == ('roberta')
  albert = albert_config(**tiny, embedding_size=16)
  assert families.exporting(families.ENCODER, albert).name == 'albert'
  with pytest.raises(ConfigError, match="byte-level BPE has no Hugging Face class"):
    families.exporting(families.ENCODER, albert, byte_level=True)
  assert families.exporting(families.ENCODER_DECODER, t5_config(**tiny)).name == 't5'
  original = t5_config(**tiny).replace(position='sinusoidal')
  with pytest.raises(ConfigError, match="position='sinusoidal' has no equivalent"):
    families.exporting(families.ENCODER_DECODER, original)
