"""``flash_attn.utils.distributed.all_gather`` (OpenRLHF imports it); raises when called."""

from flash_attn import _missing

all_gather = _missing("utils.distributed.all_gather")
