"""The suite's check for deprecated calls (tests/deprecations.py) catches what it should."""

import warnings

import jax.numpy as jnp
import optax

import deprecations


def run_as(module_name: str, source: str, **names):
  """Runs `source` as if it were code of the module `module_name`."""
  code = compile(source, f'<{module_name}>', 'exec')
  exec(code, {'__name__': module_name, **names})  # pylint: disable=exec-used


def test_a_deprecated_library_call_from_project_code_is_recorded():
  """optax.global_norm warns from inside optax (optax/_src/...): the caller is still found."""
  deprecations.take()
  with warnings.catch_warnings(record=True):
    warnings.simplefilter('always')
    run_as('transformer_jax.training.example', 'optax.global_norm({"w": x})', optax=optax,
           x=jnp.ones(3))
  found = deprecations.take()
  assert len(found) == 1 and '<transformer_jax.training.example>' in found[0], found
  assert 'global_norm' in found[0]


def test_the_same_call_from_elsewhere_is_not_the_projects():
  deprecations.take()
  with warnings.catch_warnings(record=True):
    warnings.simplefilter('always')
    run_as('some_library.module', 'optax.global_norm({"w": x})', optax=optax, x=jnp.ones(3))
    run_as('transformer_jax.layers.example', 'warnings.warn("x", UserWarning)', warnings=warnings)
  assert deprecations.take() == []
