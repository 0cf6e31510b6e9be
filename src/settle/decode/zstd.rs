//! `zstd` (RFC 8878) through ruzstd, a block at a time. ruzstd decodes whole blocks from
//! a slice and cannot stop inside one, so the frames are cut here: the frame header and
//! each block are gathered whole (a block is at most 128 KiB, §3.1.1.2.4), handed to it
//! alone, and what it decoded is drained before the next. A frame after another, and
//! skippable frames (§3.1.2), are read as the RFC says a decoder must.
//!
//! Bounds: a frame's window of at most 8 MiB (RFC 9659 §3: encoders for HTTP must keep
//! to it, decoders may refuse more), no dictionary (HTTP has none to name), one block of
//! input kept. The content checksum is skipped, not checked (its hash would be one more
//! dependency; a corrupt block fails to decode all the same, mostly).

use std::io::Read;

use ruzstd::decoding::errors::FrameDecoderError;
use ruzstd::decoding::FrameDecoder;

use super::{Coding, DecodeError, Sink};

/// A zstd frame's magic number, and a skippable frame's range of them.
const MAGIC: u32 = 0xFD2F_B528;
const SKIPPABLE: std::ops::RangeInclusive<u32> = 0x184D_2A50..=0x184D_2A5F;
/// The largest window a frame may ask for (RFC 9659 §3).
const MAX_WINDOW: u64 = 8 << 20;
/// The largest block (Block_Maximum_Size, RFC 8878 §3.1.1.2.4).
const MAX_BLOCK: usize = 128 << 10;

const CORRUPT: DecodeError = DecodeError::Corrupt(Coding::Zstd);

pub(super) struct Zstd {
    /// Input not yet decoded: less than a frame header or a block, once `feed` returns.
    pending: Vec<u8>,
    part: Part,
    frame: FrameDecoder,
    /// Frames read to their end, skippable ones too: the stream may end after one.
    frames: u64,
}

/// Where in the stream the next bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// A frame's magic number, and its header.
    Start,
    /// A skippable frame's bytes still to skip.
    Skip(u64),
    /// A block's header and content; `checksum`: whether the frame ends with one.
    Blocks { checksum: bool },
    /// The frame's content checksum, four bytes after its last block.
    Checksum,
}

impl Default for Zstd {
    fn default() -> Zstd {
        let mut frame = FrameDecoder::new();
        frame.set_max_window_size(MAX_WINDOW);
        Zstd {
            pending: Vec::new(),
            part: Part::Start,
            frame,
            frames: 0,
        }
    }
}

/// What a frame header needs read of it (RFC 8878 §3.1.1.1): its length, whether a
/// checksum ends the frame, and whether it names a dictionary. `None` while its fixed
/// bytes are not all in; an error for a reserved bit set.
fn frame_header(bytes: &[u8]) -> Result<Option<(usize, bool, bool)>, DecodeError> {
    let Some(&descriptor) = bytes.get(4) else {
        return Ok(None);
    };
    if descriptor & 0b1000 != 0 {
        return Err(CORRUPT);
    }
    let single_segment = descriptor & 0b10_0000 != 0;
    let checksum = descriptor & 0b100 != 0;
    let dictionary_bytes = [0, 1, 2, 4][usize::from(descriptor & 0b11)];
    let content_size_bytes = match descriptor >> 6 {
        0 => usize::from(single_segment),
        1 => 2,
        2 => 4,
        _ => 8,
    };
    let window_bytes = usize::from(!single_segment);
    let at = 5 + window_bytes;
    let length = at + dictionary_bytes + content_size_bytes;
    let Some(id) = bytes.get(at..at + dictionary_bytes) else {
        return Ok(None);
    };
    // A dictionary ID of zero names none.
    let dictionary = id.iter().any(|&b| b != 0);
    Ok(Some((length, checksum, dictionary)))
}

/// A block's length with its three-byte header (RFC 8878 §3.1.1.2), and whether it is
/// the frame's last.
fn block(header: [u8; 3]) -> Result<(usize, bool), DecodeError> {
    let h = u32::from_le_bytes([header[0], header[1], header[2], 0]);
    let last = h & 1 != 0;
    let size = (h >> 3) as usize;
    let content = match (h >> 1) & 0b11 {
        // Raw, compressed: `size` bytes follow. RLE: one byte, repeated `size` times.
        0 | 2 => size,
        1 => 1,
        _ => return Err(CORRUPT),
    };
    if size > MAX_BLOCK {
        return Err(CORRUPT);
    }
    Ok((3 + content, last))
}

fn decoder_error(e: FrameDecoderError) -> DecodeError {
    match e {
        FrameDecoderError::WindowSizeTooBig { .. } => DecodeError::TooDemanding(Coding::Zstd),
        _ => CORRUPT,
    }
}

impl Zstd {
    pub(super) fn ended(&self) -> bool {
        self.part == Part::Start && self.pending.is_empty() && self.frames > 0
    }

    pub(super) fn feed(&mut self, input: &[u8], sink: &mut Sink<'_>) -> Result<(), DecodeError> {
        // Taken out while the steps read it, and put back without what they took.
        let mut pending = std::mem::take(&mut self.pending);
        pending.extend_from_slice(input);
        let mut at = 0;
        let result = loop {
            match self.step(&pending[at..], sink) {
                Ok(Some(taken)) => at += taken,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        pending.drain(..at);
        self.pending = pending;
        result
    }

    /// One step over `bytes`, the input not yet taken: how much it took, or `None` where
    /// it needs more input.
    fn step(&mut self, bytes: &[u8], sink: &mut Sink<'_>) -> Result<Option<usize>, DecodeError> {
        match self.part {
            Part::Start => {
                let Some(magic) = bytes.get(..4) else {
                    return Ok(None);
                };
                let magic = u32::from_le_bytes([magic[0], magic[1], magic[2], magic[3]]);
                if SKIPPABLE.contains(&magic) {
                    let Some(size) = bytes.get(4..8) else {
                        return Ok(None);
                    };
                    let size = u32::from_le_bytes([size[0], size[1], size[2], size[3]]);
                    self.part = Part::Skip(u64::from(size));
                    return Ok(Some(8));
                }
                if magic != MAGIC {
                    return Err(CORRUPT);
                }
                let Some((length, checksum, dictionary)) = frame_header(bytes)? else {
                    return Ok(None);
                };
                if dictionary {
                    return Err(DecodeError::TooDemanding(Coding::Zstd));
                }
                let Some(header) = bytes.get(..length) else {
                    return Ok(None);
                };
                self.frame.reset(header).map_err(decoder_error)?;
                self.part = Part::Blocks { checksum };
                Ok(Some(length))
            }
            Part::Skip(0) => {
                self.part = Part::Start;
                self.frames += 1;
                Ok(Some(0))
            }
            Part::Skip(left) => {
                if bytes.is_empty() {
                    return Ok(None);
                }
                let skip = left.min(bytes.len() as u64);
                self.part = Part::Skip(left - skip);
                // At most `bytes.len()`.
                Ok(Some(skip as usize))
            }
            Part::Blocks { checksum } => {
                let Some(&[a, b, c]) = bytes.get(..3) else {
                    return Ok(None);
                };
                let (length, last) = block([a, b, c])?;
                let Some(block) = bytes.get(..length) else {
                    return Ok(None);
                };
                let (read, written) = self
                    .frame
                    .decode_from_to(block, sink.scratch)
                    .map_err(decoder_error)?;
                if read != length {
                    return Err(CORRUPT);
                }
                sink.pass(written)?;
                // The rest of what the block decoded (past its window, or all once the
                // frame is over).
                self.drain(sink)?;
                self.part = match (last, checksum) {
                    (false, _) => Part::Blocks { checksum },
                    (true, true) => Part::Checksum,
                    (true, false) => {
                        self.frames += 1;
                        Part::Start
                    }
                };
                Ok(Some(length))
            }
            Part::Checksum => {
                if bytes.len() < 4 {
                    return Ok(None);
                }
                self.frames += 1;
                self.part = Part::Start;
                Ok(Some(4))
            }
        }
    }

    /// Hand over what the decoder holds that it may let go of.
    fn drain(&mut self, sink: &mut Sink<'_>) -> Result<(), DecodeError> {
        loop {
            let n = self.frame.read(sink.scratch).map_err(|_| CORRUPT)?;
            if n == 0 {
                return Ok(());
            }
            sink.pass(n.min(sink.scratch.len()))?;
        }
    }
}
