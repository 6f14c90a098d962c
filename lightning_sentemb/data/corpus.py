"""Training corpora, tokenized once into a memory-mapped Arrow cache file (`datasets`).

Streaming, so a corpus of any size tokenizes in bounded memory: the file is read in blocks of whole
lines, split into chunks of `CHUNK_ROWS` examples, tokenized by `workers` processes (at most two
chunks per worker in flight), and each chunk is appended to the cache file as soon as it and every
chunk before it are done, in corpus order. Memory holds a few chunks, never the corpus; the cache
file is opened memory-mapped (`Dataset.from_file`), so training holds only the pages it reads.
"""

from __future__ import annotations

import csv
import gc
import hashlib
import io
import multiprocessing
import os
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from itertools import chain, islice
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
from datasets import Dataset, Features, List, Value
from lightning.pytorch.utilities import rank_zero_info
from transformers import PreTrainedTokenizerBase

from ..atomic_io import atomic_write
from ..console import progress_bar
from ..errors import SentEmbUserError
from .negation import NEGATION_COLUMN, sentence_negator
from .nli_pairs import LABELLED_COLUMNS, label_ids, senteval_nli_rows
from .paths import default_cache_dir, require_file
from .table_files import TABLE_SUFFIXES, SideLimits, table_parts, token_limit

NUMBERED_HARD_NEGATIVE = re.compile(r"hard_neg_([1-9][0-9]*)")
CACHE_VERSION = "2"  # 2: streamed, token ids as int32
CHUNK_ROWS = 2000  # examples per tokenizer call, per task of a worker and per Arrow record batch
BLOCK_BYTES = 1 << 20  # bytes read from the corpus at a time (extended to the end of its last line)
Chunk = dict[str, list]  # column -> texts (a label column: class ids)


def default_tokenize_workers() -> int:
    """The CPUs this process may run on (a SLURM or cgroup allocation, not the whole machine), at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 8))


def nli_columns(header: Collection[str], source: str = "an NLI csv") -> list[str]:
    """The training columns of an NLI csv's header (or of a tokenized example's keys), in view order:
    `sent0` (anchor), `sent1` (positive), then the hard negatives: `hard_neg`, or `hard_neg_1` ...
    `hard_neg_k` (`sentemb data mine --output-format columns`: k negatives of each pair, all in the
    anchor's batch). Other columns are ignored."""
    numbered = sorted(int(m[1]) for c in header if (m := NUMBERED_HARD_NEGATIVE.fullmatch(c)))
    problem = ("needs a header with sent0,sent1[,hard_neg] or sent0,sent1,hard_neg_1,...,hard_neg_k"
               if not {"sent0", "sent1"} <= set(header) else
               "has both hard_neg and hard_neg_k columns; keep one kind" if numbered and "hard_neg" in header else
               "numbers its hard_neg_k columns with gaps; number them 1..k"
               if numbered != list(range(1, len(numbered) + 1)) else None)
    if problem:
        raise SentEmbUserError(f"{source}: an NLI csv {problem}; got {list(header)}")
    negatives = ["hard_neg"] if "hard_neg" in header else [f"hard_neg_{k}" for k in numbered]
    return ["sent0", "sent1", *negatives]


def corpus_columns(header: Collection[str], source: str) -> list[str]:
    """The training columns of a csv's header: labelled NLI pairs `premise,hypothesis,label` (SBERT,
    `data.nli_pairs`), sentences `sent0` with their negations `negation` (SNCSE, `data.negation`), or SimCSE's
    NLI columns (`nli_columns`)."""
    if set(LABELLED_COLUMNS) <= set(header):
        return list(LABELLED_COLUMNS)
    if "sent0" in header and "sent1" not in header:
        return ["sent0", *([NEGATION_COLUMN] if NEGATION_COLUMN in header else [])]
    if "sent0" not in header:
        raise SentEmbUserError(f"{source}: a training csv needs a header with sent0 (sentences; "
                               f"sent0,{NEGATION_COLUMN} with their negations), sent0,sent1[,hard_neg...] (NLI "
                               f"triplets) or premise,hypothesis,label (labelled NLI pairs); got {list(header)}")
    return nli_columns(header, source)


# ----- reading ----------------------------------------------------------------------------------
class CorpusReader:
    """The corpus as chunks of at most `CHUNK_ROWS` examples, {column: [text]}, read as it goes.

    `.txt`: one sentence a line (column `sent0`); blank lines are skipped and counted in
    `blank_lines`. `.csv`: SimCSE's NLI file with header `sent0,sent1[,hard_neg]`, or with k hard negatives
    a pair `sent0,sent1,hard_neg_1,...,hard_neg_k` (`nli_columns`); sentences and their negations
    `sent0,negation`; labelled NLI pairs `premise,hypothesis,label` (`corpus_columns`). A folder: labelled
    NLI pairs in SentEval's layout (`data.nli_pairs`). `.jsonl` / `.parquet`: named fields, `columns`
    mapping ours to the file's (`data.table_files`). Lines are those
    of `str.splitlines` (as reading the whole file would give). Reading stops after `max_examples`
    examples (the rest of the file is not read, nor checked). `bytes_read` follows the progress.

    Bytes that are not UTF-8 are the user's to fix: one error naming the file, the line and byte
    offset of the first bad byte.
    """

    def __init__(self, path: str | os.PathLike, max_examples: int | None = None,
                 columns: Mapping[str, str] | None = None) -> None:
        self.path = require_file(path, "training corpus")
        self.columns = dict(columns or {})
        self.max_examples = max_examples or None
        self.size = sum(file.stat().st_size for file in _files_of(self.path))
        self.bytes_read = 0
        self.blank_lines = 0
        self.examples = 0

    def __iter__(self) -> Iterator[Chunk]:
        buffered: Chunk = {}
        for part in self._parts():
            for column, texts in part.items():
                buffered.setdefault(column, []).extend(texts)
            while _rows(buffered) >= CHUNK_ROWS or self._reaches_limit(_rows(buffered)):
                yield self._take(buffered)
                if self.examples == self.max_examples:
                    return
        if _rows(buffered):
            yield self._take(buffered)

    def _parts(self) -> Iterator[Chunk]:
        if self.path.is_dir():
            return self._counted(senteval_nli_rows(self.path, CHUNK_ROWS))
        if self.path.suffix in TABLE_SUFFIXES:
            return self._counted(table_parts(self.path, self.columns, CHUNK_ROWS))
        return self._csv_parts() if self.path.suffix == ".csv" else self._txt_parts()

    def _reaches_limit(self, buffered: int) -> bool:
        return self.max_examples is not None and self.examples + buffered >= self.max_examples

    def _take(self, buffered: Chunk) -> Chunk:
        """The next chunk off the front of `buffered`: `CHUNK_ROWS` examples, fewer at the end or the limit."""
        n = min(CHUNK_ROWS, _rows(buffered))
        if self.max_examples is not None:
            n = min(n, self.max_examples - self.examples)
        chunk = {column: texts[:n] for column, texts in buffered.items()}
        for texts in buffered.values():
            del texts[:n]
        self.examples += n
        return chunk

    def _txt_parts(self) -> Iterator[Chunk]:
        for text in self._text_blocks():
            lines = text.splitlines()
            sentences = [sentence for sentence in map(str.strip, lines) if sentence]
            self.blank_lines += len(lines) - len(sentences)
            yield {"sent0": sentences}

    def _csv_parts(self) -> Iterator[Chunk]:
        # quoted fields may span lines: the csv reader gets the lines of every block in turn
        lines = chain.from_iterable(io.StringIO(text, newline="") for text in self._text_blocks())
        reader = csv.DictReader(lines)
        columns = corpus_columns(reader.fieldnames or [], str(self.path))
        first_row = 2  # after the header
        while rows := list(islice(reader, CHUNK_ROWS)):
            part = {column: [row[column] for row in rows] for column in columns}
            if "label" in part:
                part["label"] = label_ids(part["label"], first_row, str(self.path))
            first_row += len(rows)
            yield part

    def _counted(self, parts: Iterable[tuple[Chunk, int]]) -> Iterator[Chunk]:
        for part, size in parts:
            self.bytes_read += size
            yield part

    def _text_blocks(self) -> Iterator[str]:
        """The file decoded in blocks of whole lines (a block ends after a newline byte, which is
        never part of a multi-byte UTF-8 character)."""
        line, rest = 1, b""
        with open(self.path, "rb") as file:
            while True:
                data = file.read(BLOCK_BYTES)
                block, rest = rest + data, b""
                if data:
                    cut = block.rfind(b"\n") + 1
                    if not cut:
                        rest = block  # no line end yet: a line longer than a block
                        continue
                    block, rest = block[:cut], block[cut:]
                if block:
                    yield self._decode(block, line)
                    self.bytes_read += len(block)
                    line += block.count(b"\n")
                if not data:
                    return

    def _decode(self, block: bytes, first_line: int) -> str:
        try:
            return block.decode("utf8")
        except UnicodeDecodeError as error:
            line = first_line + block.count(b"\n", 0, error.start)
            raise SentEmbUserError(
                f"{self.path}: not UTF-8 at line {line}, byte offset {self.bytes_read + error.start} "
                f"(byte 0x{block[error.start]:02x}); re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
            ) from None


def _rows(buffered: Chunk) -> int:
    return len(next(iter(buffered.values()), []))


def _files_of(path: Path) -> list[Path]:
    """The file, or the files of a corpus folder."""
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


# ----- tokenizing -------------------------------------------------------------------------------
class ChunkTokenizer:
    """Token ids of every text column of a chunk, without special tokens, cut to `max_tokens`, as Arrow's
    list layout (int32 offsets, int32 values): two flat arrays, cheap to send between processes. A
    label column stays one int32 array of class ids. With `negate` (`data.negation.sentence_negator`), a
    chunk of sentences without a negation column gets one (SNCSE's soft negatives, `data.negate`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_tokens: int | SideLimits,
                 negate: Callable[[list[str]], list[str]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.negate = negate

    def __call__(self, chunk: Chunk) -> dict[str, tuple[np.ndarray, np.ndarray] | np.ndarray]:
        out: dict[str, tuple[np.ndarray, np.ndarray] | np.ndarray] = {}
        if self.negate is not None and "sent0" in chunk and NEGATION_COLUMN not in chunk:
            chunk = {**chunk, NEGATION_COLUMN: self.negate(chunk["sent0"])}
        for column, texts in chunk.items():
            if column == "label":
                out[column] = np.asarray(texts, dtype=np.int32)
                continue
            limit = token_limit(self.max_tokens, column)
            rows = [ids[:limit] for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
            offsets = np.zeros(len(rows) + 1, dtype=np.int32)
            np.cumsum([len(ids) for ids in rows], out=offsets[1:])
            out[column] = offsets, np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(offsets[-1]))
        return out


_worker_tokenizer: ChunkTokenizer | None = None


def _start_worker(tokenizer: ChunkTokenizer, parent: int) -> None:
    """A worker holds the tokenizer (inherited through fork, nothing pickled) and exits when the
    process that started it is gone, so a run killed with -9 leaves no worker behind. SIGTERM (what
    `Pool.terminate` sends at the end) gets its default action back: a Python handler inherited from the
    parent (Lightning's, the test session's) runs only in the main thread, which waits in a semaphore
    while the signal may go to the thread below, so the worker would never exit and the fit would hang."""
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()


def _tokenize_in_worker(chunk: Chunk) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return _worker_tokenizer(chunk)


@contextmanager
def _serial_tokenizers_in_children() -> Iterator[None]:
    """Forked workers run the Rust tokenizer on one thread each (the workers are the parallelism;
    a forked child would otherwise disable it with a warning once the parent has used it)."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def tokenized_chunks(chunks: Iterable[Chunk], tokenize: ChunkTokenizer, workers: int) -> Iterator[dict]:
    """`tokenize(chunk)` of every chunk, in order: in this process with `workers` <= 1 (or where
    processes cannot fork), else in `workers` forked processes with at most 2 chunks per worker in
    flight (the reader waits for the oldest result before handing out more, so memory holds at most
    2 × workers chunks)."""
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(tokenize, chunks)
        return
    gc.freeze()  # the workers share the parent's objects; a collection in them would copy their pages
    try:
        with _serial_tokenizers_in_children():
            pool = multiprocessing.get_context("fork").Pool(workers, _start_worker, (tokenize, os.getpid()))
    finally:
        gc.unfreeze()
    with pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_tokenize_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ----- the cache --------------------------------------------------------------------------------
def _cache_key(path: Path, tokenizer: PreTrainedTokenizerBase, max_tokens: int | SideLimits, max_examples: int | None,
               negate: str | None, columns: Mapping[str, str] | None) -> str:
    stats = [(file.name, file.stat()) for file in _files_of(path)]
    parts = [CACHE_VERSION, str(path.resolve()), *(f"{name} {stat.st_size} {stat.st_mtime_ns}" for name, stat in stats),
             tokenizer.name_or_path, str(len(tokenizer)), str(max_tokens), str(max_examples)]
    if negate is not None:
        parts.append(f"negate {negate}")
    if columns:
        parts.append(f"columns {sorted(columns.items())}")
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


def corpus_cache_path(
    path: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int | SideLimits,
    cache_dir: str | os.PathLike | None = None,
    max_examples: int | None = None,
    negate: str | None = None,
    columns: Mapping[str, str] | None = None,
) -> Path:
    """Where the tokenized corpus is cached: named by the file's identity (path, size, mtime; a folder's
    files'), the tokenizer, the length(s), `max_examples`, `negate` and `columns`: any change gives a new cache."""
    path = require_file(path, "training corpus")
    cache = Path(cache_dir or default_cache_dir())
    return cache / f"{path.stem}-{_cache_key(path, tokenizer, max_tokens, max_examples, negate, columns)}.arrow"


def tokenize_corpus(
    path: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int | SideLimits,
    cache_dir: str | os.PathLike | None = None,
    max_examples: int | None = None,
    negate: str | None = None,
    workers: int | None = None,
    columns: Mapping[str, str] | None = None,
) -> Path:
    """Tokenize the corpus into its cache file (`corpus_cache_path`) unless it is there; return the path.

    Each text column becomes token ids without special tokens, cut to `max_tokens` (`SideLimits`: the
    query column to one length, the others to another); `columns`: a table file's fields (`CorpusReader`). The file is
    written under a temporary name beside it and renamed once complete (`atomic_write`), so a
    killed run never leaves a file at the cached name. `negate`: a parser (`data.negation.load_parser`:
    a spaCy pipeline or `lexicon`) whose negation of each sentence becomes the column `negation`, where
    the corpus has none. `workers`: tokenizer processes (default `default_tokenize_workers()`; 1 = in
    this process).
    """
    final = corpus_cache_path(path, tokenizer, max_tokens, cache_dir, max_examples, negate, columns)
    if final.exists():
        return final
    reader = CorpusReader(path, max_examples, columns)
    workers = default_tokenize_workers() if workers is None else workers
    start = time.perf_counter()
    tokenize = ChunkTokenizer(tokenizer, max_tokens, None if negate is None else sentence_negator(negate))
    atomic_write(final, lambda file: _write_arrow(file, reader, tokenize, workers))
    seconds = time.perf_counter() - start
    if reader.blank_lines:
        rank_zero_info(f"{reader.path}: skipped {reader.blank_lines} blank line(s)")
    rank_zero_info(f"{reader.path}: {reader.examples:,} examples tokenized in {seconds:.1f} s "
                   f"({reader.examples / seconds:,.0f} lines/s, {workers} worker(s)) into {final}")
    return final


def _write_arrow(file: IO[bytes], reader: CorpusReader, tokenize: ChunkTokenizer, workers: int) -> None:
    """The Arrow stream `Dataset.from_file` opens, one record batch per chunk, with progress in lines/s."""
    writer = schema = None
    start = time.perf_counter()
    with progress_bar(total=reader.size, unit="B", unit_scale=True, unit_divisor=1024,
                      desc=f"tokenize {reader.path.name}", leave=False) as progress:
        for columns in tokenized_chunks(reader, tokenize, workers):
            if writer is None:
                schema = Features({column: Value("int32") if column == "label" else List(Value("int32"))
                                   for column in columns}).arrow_schema
                writer = pa.ipc.new_stream(file, schema)
            arrays = [pa.array(columns[name]) if name == "label"
                      else pa.ListArray.from_arrays(*map(pa.array, columns[name])) for name in schema.names]
            writer.write_batch(pa.record_batch(arrays, schema=schema))
            progress.update(reader.bytes_read - progress.n)
            progress.set_postfix_str(f"{reader.examples:,} lines, "
                                     f"{reader.examples / (time.perf_counter() - start):,.0f} lines/s", refresh=False)
    if writer is None:
        raise SentEmbUserError(f"{reader.path}: the training corpus holds no sentence (empty or blank lines only); "
                               "point --data.train_file at a corpus with sentences in it")
    writer.close()


def open_tokenized_corpus(final: Path) -> Dataset:
    """The cache file, memory-mapped."""
    return Dataset.from_file(str(final))

