"""`retrieval`: Okapi BM25 search over a local corpus file (no network).

Corpus formats: `.jsonl`, one object per line with "text" (or "contents"), optional "title" and
"id"; any other file: one document per non-empty line. Words are lower-cased \\w+ runs.

  score(d, q) = sum over distinct query words t of
                idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
  idf(t)      = ln(1 + (N - n(t) + 0.5) / (n(t) + 0.5))      (never negative)
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

from megarl.rollout.tools import TOOLS, Tool, ToolError

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25Index:
    def __init__(self, documents: list[str], k1: float = 1.5, b: float = 0.75):
        if not documents:
            raise ValueError("BM25Index needs at least one document")
        self.k1, self.b = k1, b
        self.lengths = []
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)  # word -> (document, count)
        for i, doc in enumerate(documents):
            counts = Counter(words(doc))
            self.lengths.append(sum(counts.values()))
            for word, count in counts.items():
                self.postings[word].append((i, count))
        self.avgdl = sum(self.lengths) / len(self.lengths) or 1.0

    def idf(self, word: str) -> float:
        n, total = len(self.postings.get(word, ())), len(self.lengths)
        return math.log(1 + (total - n + 0.5) / (n + 0.5))

    def search(self, query: str, top_k: int) -> list[tuple[int, float]]:
        """(document index, score) of the best `top_k` documents with a positive score, best first."""
        scores: dict[int, float] = defaultdict(float)
        for word in set(words(query)):
            idf = self.idf(word)
            for doc, tf in self.postings.get(word, ()):
                norm = self.k1 * (1 - self.b + self.b * self.lengths[doc] / self.avgdl)
                scores[doc] += idf * tf * (self.k1 + 1) / (tf + norm)
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
        return [(doc, score) for doc, score in ranked[:top_k] if score > 0]


def load_corpus(path: str | Path) -> list[dict]:
    """Documents as {"id", "text"} from a .jsonl file or a one-document-per-line text file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"retrieval corpus '{path}' does not exist")
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                docs.append({"id": str(len(docs)), "text": line.strip()})
                continue
            obj = json.loads(line)
            text = obj.get("text", obj.get("contents"))
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: a corpus line needs a string 'text' (or 'contents')")
            if obj.get("title"):
                text = f"{obj['title']}\n{text}"
            docs.append({"id": str(obj.get("id", len(docs))), "text": text})
    return docs


@TOOLS.register("retrieval")
class Retrieval(Tool):
    name = "retrieval"
    description = "Search a local document collection; returns the best matching passages."
    parameters = {"type": "object",
                  "properties": {"query": {"type": "string", "description": "what to search for"},
                                 "top_k": {"type": "integer", "description": "how many passages"}},
                  "required": ["query"]}

    def __init__(self, corpus: str, top_k: int = 3, max_top_k: int = 10, max_chars_per_doc: int = 500,
                 k1: float = 1.5, b: float = 0.75):
        self.docs = load_corpus(corpus)
        self.index = BM25Index([d["text"] for d in self.docs], k1, b)
        self.top_k, self.max_top_k, self.max_chars = top_k, max_top_k, max_chars_per_doc

    def run(self, query: str, top_k: int | None = None) -> str:
        if not isinstance(query, str) or not query.strip():
            raise ToolError("'query' must be a non-empty string")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ToolError("'top_k' must be a positive integer")
        hits = self.index.search(query, min(top_k or self.top_k, self.max_top_k))
        if not hits:
            return "no matching documents"
        return "\n".join(f"[{rank}] ({self.docs[doc]['id']}) {self.docs[doc]['text'][:self.max_chars]}"
                         for rank, (doc, _) in enumerate(hits, 1))
