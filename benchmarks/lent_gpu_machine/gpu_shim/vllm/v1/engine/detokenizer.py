"""``check_stop_strings`` as in vLLM 0.29.0 (``vllm/v1/engine/detokenizer.py``, Apache-2.0, the vLLM authors)."""

import sys
from typing import List, Optional, Tuple


def check_stop_strings(output_text: str, new_char_count: int, stop: List[str],
                       include_in_output: bool) -> Optional[Tuple[str, int]]:
    """Check if any stop strings are matched and truncate sequence output text accordingly.

    Returns tuple (stop_string, offset) if matched or else None, where offset is the length to which output_text
    should be truncated, or -1 for no truncation. When several stop strings match within the newly generated text,
    the one that completes earliest in the text is selected; ties are broken by stop-list order.
    """
    if not new_char_count or not stop:
        return None
    best_stop_str: Optional[str] = None
    best_stop_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        stop_string_len = len(stop_str)
        stop_index = output_text.find(stop_str, 1 - new_char_count - stop_string_len)  # only the new text
        if stop_index == -1:
            continue
        end = stop_index + stop_string_len
        if end < best_end:
            best_stop_str, best_stop_index, best_end = stop_str, stop_index, end
    if best_stop_str is None:
        return None
    if include_in_output:
        if best_end >= len(output_text):
            return best_stop_str, -1
        return best_stop_str, best_end
    return best_stop_str, best_stop_index
