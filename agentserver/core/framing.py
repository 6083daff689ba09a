"""Wire framing, sans I/O: each frame is a 4-byte unsigned big-endian length, then that
many bytes (one UTF-8 ``<message>`` envelope).

:class:`FrameDecoder` is fed whatever bytes arrive and hands out complete frames. A
declared length above the limit raises :class:`FrameTooLarge` as soon as the 4 length
bytes are in, before any of the body is buffered, so an oversize frame never costs memory.
"""

from __future__ import annotations

import struct

from agentserver.core.errors import AgentServerError

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
#: The largest length the header can express.
MAX_FRAME_LIMIT = 2**32 - 1


class FramingError(AgentServerError):
    """The peer broke the framing rules."""


class FrameTooLarge(FramingError):
    """A frame declared more bytes than allowed."""

    def __init__(self, declared: int, limit: int) -> None:
        super().__init__(f"frame of {declared} bytes exceeds the limit of {limit}")
        self.declared = declared
        self.limit = limit


def encode_frame(body: bytes) -> bytes:
    """``body`` with its length prefix."""
    if len(body) > MAX_FRAME_LIMIT:
        raise ValueError("frame too large for a 4-byte length")
    return HEADER.pack(len(body)) + body


def encode_frames(bodies: list[bytes]) -> bytes:
    """Several frames as one buffer (one write for a batch of replies)."""
    parts: list[bytes] = []
    pack = HEADER.pack
    for body in bodies:
        parts.append(pack(len(body)))
        parts.append(body)
    return b"".join(parts)


class FrameDecoder:
    """Incremental decoder. ``max_frame`` bounds one frame's body; buffered bytes never
    exceed ``max_frame + HEADER_SIZE`` plus one read's worth."""

    __slots__ = ("_buf", "_need", "_pos", "max_frame")

    def __init__(self, max_frame: int) -> None:
        if not 0 < max_frame <= MAX_FRAME_LIMIT:
            raise ValueError("max_frame must be in 1..2**32-1")
        self.max_frame = max_frame
        self._buf = bytearray()
        self._pos = 0
        # Body length of the frame being read, once its header is in; else -1.
        self._need = -1

    def feed(self, data: bytes | bytearray) -> None:
        """Add received bytes."""
        if self._pos:
            # Compact lazily: drop consumed bytes only when new data arrives.
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next complete frame body, or None if more bytes are needed.
        Raises :class:`FrameTooLarge` (the decoder is then unusable)."""
        buf = self._buf
        pos = self._pos
        if self._need < 0:
            if len(buf) - pos < HEADER_SIZE:
                return None
            (need,) = HEADER.unpack_from(buf, pos)
            if need > self.max_frame:
                raise FrameTooLarge(need, self.max_frame)
            pos += HEADER_SIZE
            self._pos = pos
            self._need = need
        need = self._need
        if len(buf) - pos < need:
            return None
        body = bytes(buf[pos : pos + need])
        self._pos = pos + need
        self._need = -1
        return body

    def frames(self) -> list[bytes]:
        """Every complete frame now buffered (raises like :meth:`next_frame`)."""
        out = []
        while (frame := self.next_frame()) is not None:
            out.append(frame)
        return out

    def take_remainder(self) -> bytes:
        """Hand back every byte received and not yet returned as a frame (including a
        partly read header), leaving the decoder empty. For handing over a stream after a
        handshake frame."""
        rest = bytes(self._buf[self._pos :])
        if self._need >= 0:
            rest = HEADER.pack(self._need) + rest
        self._buf = bytearray()
        self._pos = 0
        self._need = -1
        return rest

    @property
    def mid_frame(self) -> bool:
        """True while part of a frame (header or body) has arrived but not all of it."""
        return self._need >= 0 or len(self._buf) > self._pos

    @property
    def buffered(self) -> int:
        """Bytes received and not yet handed out."""
        return len(self._buf) - self._pos
