"""``flash_attn.bert_padding`` names OpenRLHF imports; each raises when called."""

from flash_attn import _missing

index_first_axis = _missing("bert_padding.index_first_axis")
pad_input = _missing("bert_padding.pad_input")
rearrange = _missing("bert_padding.rearrange")
unpad_input = _missing("bert_padding.unpad_input")
