"""The machinery every Hugging Face converter shares: a name table and the walks over it.

A converter describes its family once, as a table

    {HF name: (our param path, HF shape, HF array -> ours, our array -> HF's)}

and this module does the rest in both directions, so the importers and exporters of all
families check and name bad tensors the same way:

- `TableBuilder`: a table written entry by entry, in the layouts the families' layers share
  (linear layers, projections onto and from attention heads, norms).
- `canonical_names`: a state dict's names made the table's (a prefix stripped or added,
  buffers dropped), refusing a name present both with and without the prefix;
  `causal_lm_names` for the causal LMs whose head may be tied to the embedding.
- `check_state`: one ConfigError line naming unknown, missing or mis-shaped tensors.
- `params_from_table`: the checks, then our nested param dict (import).
- `ParamReader` / `state_from_table`: our params read by path and written under HF names,
  naming params that do not fit or that nothing read (export).
"""

from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import numpy as np

from transformer_jax.errors import ConfigError
from transformer_jax.layers.scan_layout import unstack_layers

# HF name -> (our param path, HF shape, HF array -> ours, our array -> HF's).
Table = dict[str, tuple[tuple[str, ...], tuple[int, ...], Callable, Callable]]


def same(x):
  """The identity: an entry whose layout is the same on both sides."""
  return x


def transpose(w):
  """nn.Linear's [out, in] weight <-> our [in, out] kernel."""
  return np.ascontiguousarray(w.T)


class TableBuilder:
  """Writes a `Table` entry by entry, in the layouts every family's layers share: `table` is
  the result. `bias=False` leaves a layer's bias out (LLaMA has none)."""

  def __init__(self):
    self.table: Table = {}

  def same(self, hf: str, path: tuple[str, ...], shape: tuple[int, ...]) -> None:
    """A tensor laid out alike on both sides (an embedding table, a bias vector)."""
    self.table[hf] = (path, shape, same, same)

  def linear(self, hf: str, path: tuple[str, ...], out: int, inp: int, bias: bool = True) -> None:
    """nn.Linear `hf`: weight [out, in] <-> our kernel [in, out], bias [out]."""
    self.table[f'{hf}.weight'] = (path + ('kernel',), (out, inp), transpose, transpose)
    if bias:
      self.same(f'{hf}.bias', path + ('bias',), (out,))

  def to_heads(self, hf: str, path: tuple[str, ...], width: int, heads: int, head_dim: int,
               bias: bool = True) -> None:
    """A projection onto attention heads: weight [heads * head_dim, width] <-> kernel [width,
    heads, head_dim] (HF orders the columns head-major, as our axes), bias [heads * head_dim] <->
    [heads, head_dim]."""
    self.table[f'{hf}.weight'] = (path + ('kernel',), (heads * head_dim, width),
                                  lambda w: transpose(w).reshape(width, heads, head_dim),
                                  lambda k: transpose(k.reshape(width, heads * head_dim)))
    if bias:
      self.table[f'{hf}.bias'] = (path + ('bias',), (heads * head_dim,),
                                  lambda b: b.reshape(heads, head_dim),
                                  lambda b: b.reshape(heads * head_dim))

  def from_heads(self, hf: str, path: tuple[str, ...], width: int, heads: int, head_dim: int,
                 bias: bool = True) -> None:
    """The attention output projection: weight [width, heads * head_dim] <-> kernel [heads,
    head_dim, width], bias [width]."""
    self.table[f'{hf}.weight'] = (path + ('kernel',), (width, heads * head_dim),
                                  lambda w: transpose(w).reshape(heads, head_dim, width),
                                  lambda k: transpose(k.reshape(heads * head_dim, width)))
    if bias:
      self.same(f'{hf}.bias', path + ('bias',), (width,))

  def norm(self, hf: str, path: tuple[str, ...], width: int, bias: bool = True) -> None:
    """A LayerNorm (weight, bias) or RMSNorm (weight only) <-> our scale (and bias)."""
    self.same(f'{hf}.weight', path + ('scale',), (width,))
    if bias:
      self.same(f'{hf}.bias', path + ('bias',), (width,))


def shown(names, limit: int = 8) -> str:
  """`names` joined for an error line: the first `limit`, then how many more."""
  names = list(names)
  more = f' (and {len(names) - limit} more)' if len(names) > limit else ''
  return ', '.join(names[:limit]) + more


def canonical_names(state: Mapping[str, Any], canonical: Callable[[str], str], prefix: str,
                    drop: Callable[[str], bool] = lambda name: False) -> tuple[dict, dict]:
  """(table name -> array, table name -> name in the file) for a checkpoint's `state`.

  `canonical` maps a file's name to the table's (stripping or adding `prefix`, which the
  error names), `drop` says which table names are buffers rather than parameters.
  """
  arrays, original = {}, {}
  for name, value in state.items():
    key = canonical(name)
    if drop(key):
      continue
    if key in arrays:
      raise ConfigError(f'checkpoint holds {name} both with and without the {prefix!r} prefix')
    arrays[key], original[key] = np.asarray(value), name
  return arrays, original


def causal_lm_names(state: Mapping[str,
                                   Any], prefix: str, head: str, embedding: str, tie_output: bool,
                    drop: Callable[[str], bool] = lambda name: False) -> tuple[dict, dict]:
  """`canonical_names` of a causal LM's state dict (LLaMA, OPT): names of a bare base model get
  the `prefix` its ...ForCausalLM class writes, buffers (`drop`) go, and a tied `head` goes too:
  it must equal the `embedding` (one ConfigError line if it differs)."""
  full = lambda name: name if name.startswith(prefix) or name == head else prefix + name
  arrays, original = canonical_names(state, full, prefix, drop=drop)
  if tie_output and head in arrays:
    weight, table = arrays.pop(head), arrays.get(embedding)
    if table is not None and not np.array_equal(np.asarray(weight), np.asarray(table)):
      raise ConfigError(f'{head} differs from {embedding} but config.json says '
                        'tie_word_embeddings=true; set it to false to import the separate head')
  return arrays, original


def strip_prefix(prefix: str) -> Callable[[str], str]:
  """A `canonical` for `canonical_names`: names with `prefix` lose it, others stay."""
  return lambda name: name[len(prefix):] if name.startswith(prefix) else name


def check_state(shapes: Mapping[str, tuple[int, ...]], arrays: Mapping[str, Any],
                original: Mapping[str, str] | None = None, *, what: str) -> None:
  """One ConfigError naming unknown, missing or mis-shaped tensors of `arrays` against
  `shapes` (table name -> shape); `original` gives the names as the file spells them,
  `what` the model ('a BERT with 2 layers') that unknown ones are not part of."""
  original = original or {}
  unknown = sorted(original.get(k, k) for k in arrays if k not in shapes)
  if unknown:
    raise ConfigError(f'checkpoint has unknown parameter(s) {shown(unknown)}: not part of {what}')
  missing = sorted(k for k in shapes if k not in arrays)
  if missing:
    raise ConfigError(f'checkpoint lacks parameter(s) {shown(missing)} that the config implies')
  wrong = [
      f'{original.get(k, k)} has shape {tuple(np.shape(arrays[k]))} but the config implies {shape}'
      for k, shape in shapes.items()
      if tuple(np.shape(arrays[k])) != tuple(shape)
  ]
  if wrong:
    raise ConfigError('; '.join(wrong))


def set_path(tree: dict, path: tuple[str, ...], value) -> None:
  """tree[path[0]][path[1]]... = value, creating the dicts on the way."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def params_from_table(table: Table, arrays: Mapping[str, Any],
                      original: Mapping[str, str] | None = None, *, dtype, what: str) -> dict:
  """Our nested params (numpy, `dtype`) from `arrays` (table name -> HF array), after
  `check_state`; each value is cast to `dtype` before the table's HF -> ours conversion."""
  check_state({name: entry[1] for name, entry in table.items()}, arrays, original, what=what)
  dtype = np.dtype(dtype)
  params: dict = {}
  for name, (path, _, to_ours, _) in table.items():
    set_path(params, path, np.ascontiguousarray(to_ours(np.asarray(arrays[name]).astype(dtype))))
  return params


def params_to_numpy(params) -> dict:
  """`params` (jax or numpy leaves, boxed or not, either layer layout) as a nested dict of
  numpy arrays in the unrolled layout ('layer_0', 'layer_1', ...) the converters read and
  write."""
  return unstack_layers(jax.tree.map(np.asarray, jax.device_get(nn.meta.unbox(params))))


class ParamReader:
  """Reads leaves of a params tree by 'a/b/c' path, as numpy arrays of `dtype` (None: their
  own), and names any leaf never read (`finish`): an exporter that drops parameters would not
  be an inverse."""

  def __init__(self, params, family: str, dtype=np.float32):
    self.params = flax.traverse_util.flatten_dict(params_to_numpy(params), sep='/')
    self.family, self.dtype, self.read = family, dtype, set()

  def __call__(self, path: str) -> np.ndarray:
    if path not in self.params:
      raise ConfigError(f'params lack {path}: not the parameters of the {self.family} model '
                        'this config describes')
    self.read.add(path)
    # Exported as float32 whatever the training dtype (bfloat16 widens exactly).
    value = self.params[path]
    return value if self.dtype is None else value.astype(self.dtype)

  def unread(self) -> list[str]:
    """The paths not read so far, sorted."""
    return sorted(set(self.params) - self.read)

  def finish(self) -> None:
    unread = self.unread()
    if unread:
      raise ConfigError(f'params have {", ".join(unread[:4])}{" ..." if len(unread) > 4 else ""}, '
                        f'which the {self.family} model this config describes has no place for')


def state_from_table(table: Table, get: ParamReader) -> dict[str, np.ndarray]:
  """{HF name: contiguous array} of the params `get` reads, through the table's ours -> HF
  conversions; one ConfigError naming a param whose shape does not fit, or one nothing read."""
  state = {}
  for name, (path, shape, _, to_hf) in table.items():
    ours = get('/'.join(path))
    try:
      value = to_hf(ours)
    except (ValueError, IndexError):  # a reshape or slice of an array of another size
      value = ours
    if tuple(value.shape) != tuple(shape):
      raise ConfigError(f'{"/".join(path)} has shape {tuple(ours.shape)}, which does not fit the '
                        f'config ({name} needs {shape})')
    state[name] = np.ascontiguousarray(value)
  get.finish()
  return state
