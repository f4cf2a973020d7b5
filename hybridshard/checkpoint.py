"""``hybridshard.checkpoint``: a sharded model's state in and out.

- Distributed checkpoints (every rank writes its shard, any topology reads them back): :func:`save`,
  :func:`load`, :func:`latest`, :func:`read_extra`; see docs/checkpointing.md.
- Full state dicts, as an unsharded model's ``state_dict()`` would hold them: :func:`full_state_dict`,
  :func:`load_full_state_dict`, :func:`full_optim_state_dict`, :func:`load_full_optim_state_dict`.
- Hugging Face safetensors: :func:`save_pretrained`, :func:`load_pretrained`.

The old top-level names (``hybridshard.save_checkpoint`` ...) are the same objects; see docs/api.md.
"""

from hybridshard.state.checkpoint import SaveResult, read_extra
from hybridshard.state.checkpoint import latest_checkpoint as latest
from hybridshard.state.checkpoint import load_checkpoint as load
from hybridshard.state.checkpoint import save_checkpoint as save
from hybridshard.state.full import full_state_dict, load_full_state_dict
from hybridshard.state.optim import full_optim_state_dict, load_full_optim_state_dict
from hybridshard.state.pretrained_load import LoadResult, load_pretrained
from hybridshard.state.pretrained_save import save_pretrained
from hybridshard.state.trust import UnsafeCheckpointError

__all__ = [
    "LoadResult",
    "SaveResult",
    "UnsafeCheckpointError",
    "full_optim_state_dict",
    "full_state_dict",
    "latest",
    "load",
    "load_full_optim_state_dict",
    "load_full_state_dict",
    "load_pretrained",
    "read_extra",
    "save",
    "save_pretrained",
]
