"""The data the retrieval benchmarks read: HotpotQA dev 500 from the test-data folder beside the checkout
(``../shared/data``, as CI places it) unless a flag names other files; a missing file is one line saying what it is
and where to get it, never a traceback."""

import os

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir, "shared", "data")
#: HotpotQA dev 500 questions with their 10 paragraphs each, 2 supporting (IRCoT format)
QUESTIONS = os.path.normpath(os.path.join(SHARED, "qa", "with_paragraphs", "hotpotqa_dev500_ircot.jsonl"))
#: the 4,858 distinct paragraphs of those questions (``id, title, contents``)
CORPUS = os.path.normpath(os.path.join(SHARED, "wiki", "hotpotqa_dev500_paragraphs.jsonl"))

WHAT = {"questions": "HotpotQA dev questions with their paragraphs (IRCoT jsonl: question_text, answers_objects, "
                     "contexts with is_supporting)",
        "corpus": "a passage jsonl (id, title, contents), e.g. the HotpotQA dev paragraphs or python -m "
                  "retriever.prepare_corpus output"}


def require_inputs(**paths: str) -> None:
    """Exit 2 with one line when a file named by ``--<flag>`` (keyword = flag name) is not there.

    Raises:
        SystemExit: naming the flag, the path, what the file is and where the default comes from.
    """
    for flag, path in paths.items():
        if not os.path.isfile(path):
            raise SystemExit(f"error: --{flag} {path} not found: {WHAT.get(flag, 'an input file')}; the default is "
                             f"the test-data folder beside the checkout (../shared/data, see its README.md for each "
                             f"file's public source): place it there or give --{flag} PATH")
