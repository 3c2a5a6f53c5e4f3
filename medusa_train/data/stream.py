"""Conversations -> shuffled, sharded ``datasets`` stream -> packed micro-batches.

The stream is a ``datasets.IterableDataset`` (so corpora larger than memory train), with a
shuffle buffer reseeded per epoch and one shard per rank. The first
``data.eval_conversations`` conversations are held out for evaluation before shuffling.

Packing (default): conversations are placed best-fit-decreasing into rows of at most
``max_length`` tokens (a micro-batch is as wide as its fullest row, so padding is only the
slack bin packing leaves); each keeps its own positions (restarting at 0) and a document id, and
the trainer's attention mask is block-diagonal so no conversation sees another. With
``packing=false`` conversations are length-bucketed and right-padded instead. Either way the
padding fraction is counted and reported.

Everything is a deterministic function of (seed, epoch, rank), so resuming replays the
stream and skips the micro-batches already consumed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from inference.errors import UserError
from .readers import ReadStats, iter_conversations
from .tokenize import IGNORE, Encoded, TemplateRefused, encode_conversation


@dataclass
class StreamStats:
    conversations: int = 0
    truncated: int = 0
    no_labels: int = 0   # dropped: no reply token within max_length (or none located in the rendering)
    unlabelled: int = 0  # kept without a reply token (heads.train_on=all: its other positions are trained on)
    unlocated_replies: int = 0   # replies left unlabelled: the template rewrote them past recognition
    tokens: int = 0  # real tokens in batches
    padding: int = 0  # padding tokens in batches
    label_tokens: int = 0

    @property
    def padding_fraction(self) -> float:
        total = self.tokens + self.padding
        return self.padding / total if total else 0.0

    def as_dict(self) -> dict:
        return {**self.__dict__, "padding_fraction": round(self.padding_fraction, 4)}

    def as_counts(self) -> dict:
        """Every counter, as numbers that add up over ranks."""
        return dict(self.__dict__)

    # What ``count`` adds up: a checkpoint saves them and a resume restores them, so the padding fraction
    # is over the whole run (the resumed stream replays the skipped batches without counting them).
    BATCH_COUNTERS = ("tokens", "padding", "label_tokens")

    def batch_counts(self) -> dict:
        return {k: getattr(self, k) for k in self.BATCH_COUNTERS}

    def restore_batch_counts(self, counts: dict) -> None:
        for k in self.BATCH_COUNTERS:
            setattr(self, k, int(counts.get(k, 0)))

    def count(self, batch: dict) -> None:
        """Add one training micro-batch's real, padding and label tokens (online or cached alike)."""
        real = int((batch["doc_ids"] > 0).sum())
        self.tokens += real
        self.padding += batch["doc_ids"].numel() - real
        self.label_tokens += int((batch["labels"] != IGNORE).sum())


def _conversation_records(source, split, system_prompt, start, stop, stats):
    for i, messages in enumerate(iter_conversations(source, split, stats, system_prompt)):
        if stop is not None and i >= stop:
            return
        if i >= start:
            yield {"messages": messages}


@dataclass
class ConversationStream:
    """Tokenised conversations of one split (train or eval) for one rank."""

    data: object  # DataConfig
    tokenizer: object
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    eval_split: bool = False
    read_stats: ReadStats = field(default_factory=ReadStats)
    stats: StreamStats = field(default_factory=StreamStats)
    # The epoch whose reading ``read_stats`` counts: the first this process reads (a resumed run may start past
    # epoch 0), so the source is reported once, not once per epoch, and never as zeros because epoch 0 was skipped.
    counted_epoch: Optional[int] = None
    # Where conversations the chat template refuses are counted, if not in this stream's own ``read_stats``: the
    # held-out stream counts them with the training stream's, the counts the run's summary reports.
    refusals: Optional[ReadStats] = None
    # Conversations with no reply token within max_length are kept (heads.train_on=all's training split), not
    # dropped: the user's turns they hold are trained on too (a long pasted prompt was a conversation lost).
    keep_unlabelled: bool = False
    # This rank's own share of those refusals (its shard of the training split; every rank reads the whole source
    # and the whole held-out split): what the run's summary adds up over ranks (``RankData.run_counts``)
    shard_refusals: Counter = field(default_factory=Counter)

    def _read_stats(self, epoch: int) -> ReadStats:
        if self.counted_epoch is None:
            self.counted_epoch = epoch
        return self.read_stats if epoch == self.counted_epoch else ReadStats()

    def dataset(self, epoch: int, stats: ReadStats):
        import datasets   # lazy: 1.1 s to import, only once a stream is read
        from datasets.distributed import split_dataset_by_node   # lazy: as datasets

        d = self.data
        n_eval = d.eval_conversations
        if self.eval_split:
            start, stop = 0, n_eval
        else:
            start = n_eval
            stop = None if d.max_conversations is None else n_eval + d.max_conversations
        gen = functools.partial(_conversation_records, d.source, d.split, d.system_prompt, start, stop, stats)
        ds = datasets.IterableDataset.from_generator(gen)
        shuffled = not self.eval_split and d.shuffle_buffer > 1
        if shuffled:
            ds = ds.shuffle(seed=self.seed, buffer_size=d.shuffle_buffer)
        if self.world_size > 1:
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
        if shuffled:   # after the split: the split dataset does not keep an epoch set before it (datasets 5.x)
            ds.set_epoch(epoch)
        return ds

    def encoded(self, epoch: int = 0) -> Iterator[Encoded]:
        stats = self._read_stats(epoch)
        seen = 0
        for record in self.dataset(epoch, stats):
            try:
                enc = encode_conversation(self.tokenizer, record["messages"], self.data.max_length,
                                          self.keep_unlabelled)
            except TemplateRefused as e:  # this conversation only: dropped and counted like an unusable record
                (self.refusals if self.refusals is not None else stats).refuse(e.reason)
                if stats is self.read_stats and not self.eval_split:
                    self.shard_refusals[e.reason] += 1
                # Held-out ones refused leave a smaller evaluation set (as those without a label do); a training
                # split refused whole is refused with the reason below.
                seen += int(self.eval_split)
                continue
            seen += 1
            if enc is None:
                self.stats.no_labels += 1
                continue
            self.stats.conversations += 1
            self.stats.unlabelled += int(all(label == IGNORE for label in enc.labels[1:]))
            self.stats.truncated += int(enc.truncated)
            self.stats.unlocated_replies += enc.unlocated
            yield enc
        if seen == 0 and stats is self.read_stats:
            what = "evaluation" if self.eval_split else "training"
            raise UserError(f"data source {self.data.source!r} gave no {what} conversations "
                            f"({self.read_stats.summary()})")


def pack(docs: list[Encoded], row_len: int) -> list[list[Encoded]]:
    """Best-fit-decreasing bin packing of documents into rows of ``row_len`` tokens."""
    rows: list[list[Encoded]] = []
    free: list[int] = []
    for doc in sorted(docs, key=lambda e: len(e.input_ids), reverse=True):
        n = len(doc.input_ids)
        best = -1
        for i, f in enumerate(free):
            if n <= f and (best < 0 or f < free[best]):
                best = i
        if best < 0:
            rows.append([doc])
            free.append(row_len - n)
        else:
            rows[best].append(doc)
            free[best] -= n
    return rows


def collate(rows: list[list[Encoded]], pad_id: int, row_len: Optional[int] = None) -> dict:
    """Rows of documents -> tensors: input_ids, labels, position_ids, doc_ids (0 = padding)."""
    width = row_len or max(sum(len(d.input_ids) for d in row) for row in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((b, width), dtype=torch.long)
    doc_ids = torch.zeros((b, width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for j, doc in enumerate(row, start=1):
            n = len(doc.input_ids)
            input_ids[r, at:at + n] = torch.tensor(doc.input_ids)
            labels[r, at:at + n] = torch.tensor(doc.labels)
            position_ids[r, at:at + n] = torch.arange(n)
            doc_ids[r, at:at + n] = j
            at += n
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "doc_ids": doc_ids}


class MicroBatches:
    """Infinite iterator of training micro-batches with a resumable position (epoch, index)."""

    def __init__(self, stream: ConversationStream, micro_batch_size: int, pad_id: int,
                 buffer: int = 256, epoch: int = 0, index: int = 0):
        self.stream = stream
        self.micro = micro_batch_size
        self.pad_id = pad_id
        self.buffer = max(buffer, micro_batch_size)
        self.epoch, self.index = epoch, index

    def state(self) -> dict:
        """The position; with the stream's rule when it keeps unlabelled conversations (a run resumed from a
        checkpoint without it began under the rule that dropped them, and reads that stream again)."""
        kept = {"keeps_unlabelled": True} if self.stream.keep_unlabelled else {}
        return {"epoch": self.epoch, "index": self.index, **kept}

    def _epoch_batches(self, epoch: int) -> Iterator[dict]:
        data = self.stream.data
        buf: list[Encoded] = []

        def flush():
            if data.packing:
                rows = pack(buf, data.max_length)
                for i in range(0, len(rows), self.micro):
                    yield collate(rows[i:i + self.micro], self.pad_id)  # width = fullest row
            else:
                docs = sorted(buf, key=lambda e: len(e.input_ids))
                for i in range(0, len(docs), self.micro):
                    yield collate([[d] for d in docs[i:i + self.micro]], self.pad_id)

        for enc in self.stream.encoded(epoch):
            buf.append(enc)
            if len(buf) >= self.buffer:
                yield from flush()
                buf = []
        if buf:
            yield from flush()

    def __iter__(self) -> Iterator[dict]:
        while True:
            produced = 0
            for i, batch in enumerate(self._epoch_batches(self.epoch)):
                produced += 1
                if i < self.index:
                    continue  # resuming: replay the deterministic stream up to where we stopped
                self.index = i + 1
                self.stream.stats.count(batch)
                yield batch
            if produced == 0:
                raise UserError(f"data source {self.stream.data.source!r} produced no training batches")
            self.epoch, self.index = self.epoch + 1, 0


def eval_batches(stream: ConversationStream, micro_batch_size: int, pad_id: int) -> list[dict]:
    """The held-out conversations, length-bucketed (eval is small; kept in memory)."""
    docs = sorted(stream.encoded(0), key=lambda e: len(e.input_ids))
    return [collate([[d] for d in docs[i:i + micro_batch_size]], pad_id)
            for i in range(0, len(docs), micro_batch_size)]


class RankData:
    """One rank's online data: its shard of the training stream (resumable micro-batches) and the
    held-out evaluation batches, with the counters the run's summary reports."""

    def __init__(self, data, tokenizer, seed: int, rank: int, world_size: int, micro_batch_size: int,
                 pad_id: int, keep_unlabelled: bool = False):
        self.data, self.micro, self.pad_id = data, micro_batch_size, pad_id
        self.train_stream = ConversationStream(data, tokenizer, seed=seed, rank=rank, world_size=world_size,
                                               keep_unlabelled=keep_unlabelled)
        self.eval_stream = ConversationStream(data, tokenizer, eval_split=True,
                                              refusals=self.train_stream.read_stats)
        self._eval: Optional[list[dict]] = None

    @property
    def stats(self) -> StreamStats:
        return self.train_stream.stats

    @property
    def read_stats(self) -> ReadStats:
        return self.train_stream.read_stats

    def batches(self, epoch: int = 0, index: int = 0) -> MicroBatches:
        if epoch or index:  # a resumed run: its summary's counts cover only what this process reads from here
            self.read_stats.resumed_at = (epoch, index)
        return MicroBatches(self.train_stream, self.micro, self.pad_id, buffer=self.data.bucket_buffer,
                            epoch=epoch, index=index)

    def run_counts(self) -> tuple[ReadStats, StreamStats]:
        """The source's and the tokenisation's counts for the run's summary, over every rank (collective with 2+
        ranks): each rank reads the whole source but tokenises, and meets the template's refusals in, its shard
        only, so rank 0's own counts would report a fraction of the refusals and of the conversations."""
        world = self.train_stream.world_size
        if world == 1 or not torch.distributed.is_initialized():
            return self.read_stats, self.stats
        mine = (dict(self.train_stream.shard_refusals), self.stats.as_counts())
        every = [None] * world
        torch.distributed.all_gather_object(every, mine)
        read = dataclasses.replace(self.read_stats, dropped=Counter(self.read_stats.dropped))
        stats = StreamStats()
        for rank, (refused, counts) in enumerate(every):
            for why, n in refused.items():
                if rank != self.train_stream.rank:   # this rank's own are in its read stats already
                    read.recovered -= n
                    read.dropped[why] += n
            for key, n in counts.items():
                setattr(stats, key, getattr(stats, key) + n)
        return read, stats

    def eval_batches(self) -> list[dict]:
        if self._eval is None:  # tokenised once, on first use (a complete feature cache never needs it)
            self._eval = eval_batches(self.eval_stream, max(self.micro, 4), self.pad_id)
        return self._eval


def first_epoch(stream: ConversationStream, micro_batch_size: int, pad_id: int, buffer: int) -> Iterator[dict]:
    """Epoch 0 of ``MicroBatches`` over ``stream``, then stop (what the feature cache stores)."""
    batches = MicroBatches(stream, micro_batch_size, pad_id, buffer=buffer)
    for batch in batches:
        if batches.epoch > 0:  # the first batch of the next epoch: epoch 0 is over
            return
        yield batch


def check_training_data(data, tokenizer=None) -> None:
    """Refuse data that would give no training batch, reading only up to the first conversation that would:
    called before anything is written into the run's folder (``preflight`` without a tokenizer, the trainer
    with the backbone's), since the stream itself finds out only at the run's first batch. Refused: a source
    with no usable conversation after the ``data.eval_conversations`` held out (an empty or malformed file,
    records that are not chats); with ``tokenizer``, one whose training conversations keep no assistant token
    within ``data.max_length``."""
    stats = ReadStats()
    start = int(data.eval_conversations)
    stop = None if data.max_conversations is None else start + int(data.max_conversations)
    training, refused = 0, 0
    for record in _conversation_records(str(data.source), data.split, data.system_prompt, start, stop, stats):
        if tokenizer is None:
            return
        try:
            encoded = encode_conversation(tokenizer, record["messages"], data.max_length)
        except TemplateRefused as e:  # dropped as the stream drops it; all refused: "gave no training conversations"
            stats.refuse(e.reason)
            refused += 1
            continue
        training += 1
        if encoded is not None:
            return
    if not training:
        held = (f"; data.eval_conversations={start} holds out the first {start} for evaluation"
                if stats.recovered and not refused else "")
        raise UserError(f"data source {data.source!r} gave no training conversations ({stats.summary()}){held}")
    raise UserError(f"data source {data.source!r} gave no training conversation with an assistant token within "
                    f"data.max_length={data.max_length} tokens ({training} read); raise data.max_length")


def token_frequencies(stream: ConversationStream, vocab_size: int, max_conversations: int) -> torch.Tensor:
    """Counts of assistant (label) tokens over the first conversations of the training stream."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    # islice: the stream counts a conversation as it yields it, so one read past the limit would be reported
    for enc in itertools.islice(stream.encoded(0), max_conversations):
        lab = torch.tensor([t for t in enc.labels if t != IGNORE], dtype=torch.long)
        counts += torch.bincount(lab, minlength=vocab_size)[:vocab_size]
    return counts
