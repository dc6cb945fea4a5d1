"""Plain data types shared by the protocol, the retrieval client, the executor and the rewards."""

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class Passage:
    """One retrieved passage (a 100-word KILT chunk or a wiki-18 / FlashRAG row).

    Attributes:
        id: corpus id of the passage.
        title: Wikipedia page title ("" when the corpus has none).
        text: passage text without the title.
        score: retriever score (inner product for dense, BM25 score for sparse); None when not returned.
    """

    id: str
    title: str
    text: str
    score: Optional[float] = None


ActionKind = Literal["query", "answer", "invalid"]


@dataclass(frozen=True)
class Action:
    """What one model turn asked for, as parsed by a protocol.

    Attributes:
        kind: "query" (the turn ended with a well-formed search call), "answer" (it contains an answer block)
            or "invalid" (neither, or malformed).
        content: the query text, the answer text, or for "invalid" a short reason (for logs only).
    """

    kind: ActionKind
    content: str
