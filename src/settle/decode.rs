//! An answer's content coding undone for the usage scanner (`cost_from = "openai_usage"`):
//! a compressed answer would otherwise hide its `usage` from [`super::usage`]. The client
//! still gets the bytes as the backend sent them; only the scanner reads them decoded.
//!
//! [`Coding::of`] reads the answer's `Content-Encoding` (RFC 9110 §8.4): none or
//! `identity`, nothing to decode; one of `gzip` (`x-gzip`, §8.4.1.3), `deflate` (§8.4.1.2:
//! zlib-wrapped, RFC 1950; raw deflate, RFC 1951, as some servers send it, is told by its
//! first two bytes), `br` (RFC 7932) or `zstd` (RFC 8878, windows up to 8 MiB as RFC 9659
//! has it); more than one coding, or another, is [`Unsupported`].
//!
//! A [`Decoder`] takes the body a chunk at a time, however it is cut, and hands what it
//! decodes to a callback: through one 16 KiB scratch buffer, allocated with the decoder,
//! never per chunk. It stops once the decoded bytes would pass a budget
//! ([`DecodeError::Exhausted`]), so a decompression bomb costs bounded CPU; a corrupt
//! stream is an error, never a panic. What was handed over before an error stands.
//!
//! Each coding's own state: gzip and deflate keep inflate's 32 KiB window; brotli a ring
//! buffer that grows to at most the stream's window (16 MiB in RFC 7932, large windows
//! refused); zstd the frame's window, at most 8 MiB, and one block of input (128 KiB).

mod zstd;

use std::fmt;

use brotli_decompressor::{BrotliDecompressStream, BrotliResult, BrotliState, StandardAlloc};
use flate2::{Crc, Decompress, FlushDecompress, Status};
use http::header::{HeaderMap, CONTENT_ENCODING};

/// The scratch buffer each decoder decodes into, a piece at a time.
const SCRATCH: usize = 16 * 1024;

/// A content coding the scanner reads through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Deflate,
    Brotli,
    Zstd,
}

impl Coding {
    /// The coding an answer's `Content-Encoding` fields name, `None` where they name none
    /// (or only `identity`). Tokens are compared without case, empty list elements
    /// skipped (RFC 9110 §5.6.1).
    pub fn of(headers: &HeaderMap) -> Result<Option<Coding>, Unsupported> {
        let mut found = None;
        for value in headers.get_all(CONTENT_ENCODING) {
            let value = value.to_str().map_err(|_| Unsupported::Unknown)?;
            for token in value.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                let coding = match token.to_ascii_lowercase().as_str() {
                    "identity" => continue,
                    "gzip" | "x-gzip" => Coding::Gzip,
                    "deflate" => Coding::Deflate,
                    "br" => Coding::Brotli,
                    "zstd" => Coding::Zstd,
                    _ => return Err(Unsupported::Unknown),
                };
                if found.replace(coding).is_some() {
                    return Err(Unsupported::Stacked);
                }
            }
        }
        Ok(found)
    }

    /// The coding as `Content-Encoding` names it.
    pub fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
            Coding::Brotli => "br",
            Coding::Zstd => "zstd",
        }
    }
}

impl fmt::Display for Coding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why an answer's `Content-Encoding` is not decoded: its usage cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    #[error("a content coding the usage scanner does not decode")]
    Unknown,
    #[error("more than one content coding, applied one over the other")]
    Stacked,
}

impl Unsupported {
    /// The reason as logs and metrics label it.
    pub fn name(self) -> &'static str {
        match self {
            Unsupported::Unknown => "unknown_coding",
            Unsupported::Stacked => "stacked_codings",
        }
    }
}

/// Why decoding stopped before the end of the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The decoded bytes reached the budget and more were coming: the budget's worth was
    /// handed over, no more will be.
    #[error("the answer decodes to more than its budget of {budget} bytes")]
    Exhausted { budget: u64 },
    /// The stream breaks its format (or its checksum, or bytes follow its end).
    #[error("the answer's {0} stream is corrupt")]
    Corrupt(Coding),
    /// The body ended before the stream did ([`Decoder::finish`]).
    #[error("the answer's {0} stream ends early")]
    Truncated(Coding),
    /// A zstd frame asks for a window over 8 MiB (RFC 9659 §3), or a dictionary.
    #[error("the answer's {0} stream asks for more than the decoder allows")]
    TooDemanding(Coding),
}

impl DecodeError {
    /// The reason as logs and metrics label it.
    pub fn name(self) -> &'static str {
        match self {
            DecodeError::Exhausted { .. } => "exhausted",
            DecodeError::Corrupt(_) => "corrupt",
            DecodeError::Truncated(_) => "truncated",
            DecodeError::TooDemanding(_) => "too_demanding",
        }
    }
}

/// An answer's body decoded as it passes, a chunk at a time ([`Decoder::feed`]), up to a
/// budget of decoded bytes. After an error every call returns that error again.
pub struct Decoder {
    coding: Coding,
    state: State,
    out: Budget,
    scratch: Box<[u8; SCRATCH]>,
    failed: Option<DecodeError>,
}

/// The decoded bytes handed over so far, against the budget.
struct Budget {
    budget: u64,
    decoded: u64,
}

impl Budget {
    /// Hand `bytes` to `out`, as far as the budget goes.
    fn take(&mut self, bytes: &[u8], out: &mut impl FnMut(&[u8])) -> Result<(), DecodeError> {
        let room = self.budget - self.decoded;
        if bytes.len() as u64 > room {
            // `room` is under `bytes.len()`, a usize.
            let fits = &bytes[..room as usize];
            if !fits.is_empty() {
                out(fits);
            }
            self.decoded = self.budget;
            return Err(DecodeError::Exhausted {
                budget: self.budget,
            });
        }
        if !bytes.is_empty() {
            out(bytes);
        }
        self.decoded += bytes.len() as u64;
        Ok(())
    }
}

enum State {
    Gzip(Box<Gzip>),
    Deflate(Box<Deflate>),
    Brotli(Box<Brotli>),
    Zstd(Box<zstd::Zstd>),
}

impl Decoder {
    /// A decoder of `coding` that hands over at most `budget` decoded bytes.
    pub fn new(coding: Coding, budget: u64) -> Decoder {
        let state = match coding {
            Coding::Gzip => State::Gzip(Box::default()),
            Coding::Deflate => State::Deflate(Box::default()),
            Coding::Brotli => State::Brotli(Box::default()),
            Coding::Zstd => State::Zstd(Box::default()),
        };
        Decoder {
            coding,
            state,
            out: Budget { budget, decoded: 0 },
            scratch: Box::new([0; SCRATCH]),
            failed: None,
        }
    }

    /// The decoder `headers` call for (see [`Coding::of`]): `None` where the answer is
    /// not coded.
    pub fn of(headers: &HeaderMap, budget: u64) -> Result<Option<Decoder>, Unsupported> {
        Ok(Coding::of(headers)?.map(|c| Decoder::new(c, budget)))
    }

    pub fn coding(&self) -> Coding {
        self.coding
    }

    /// The decoded bytes handed over so far.
    pub fn decoded(&self) -> u64 {
        self.out.decoded
    }

    /// Decode the next `chunk` of the body, handing what it decodes to `out` (in pieces of
    /// at most 16 KiB).
    pub fn feed(&mut self, chunk: &[u8], mut out: impl FnMut(&[u8])) -> Result<(), DecodeError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let sink = &mut Sink {
            scratch: &mut self.scratch[..],
            budget: &mut self.out,
            out: &mut out,
        };
        let fed = match &mut self.state {
            State::Gzip(g) => g.feed(chunk, sink),
            State::Deflate(d) => d.feed(chunk, sink),
            State::Brotli(b) => b.feed(chunk, sink),
            State::Zstd(z) => z.feed(chunk, sink),
        };
        fed.map_err(|e| *self.failed.insert(e))
    }

    /// The body has ended: whether the stream ended with it, complete.
    pub fn finish(&mut self) -> Result<(), DecodeError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let ended = match &self.state {
            State::Gzip(g) => g.ended(),
            State::Deflate(d) => d.ended(),
            State::Brotli(b) => b.ended,
            State::Zstd(z) => z.ended(),
        };
        if ended {
            Ok(())
        } else {
            Err(*self.failed.insert(DecodeError::Truncated(self.coding)))
        }
    }
}

/// Where a coding's output goes: decoded into `scratch`, then handed to `out` within the
/// answer's `budget`. One value, which every coding's steps pass on whole.
struct Sink<'a> {
    scratch: &'a mut [u8],
    budget: &'a mut Budget,
    out: &'a mut dyn FnMut(&[u8]),
}

impl Sink<'_> {
    /// Hand the first `n` bytes of `scratch` to `out`, within the budget.
    fn pass(&mut self, n: usize) -> Result<(), DecodeError> {
        self.budget.take(&self.scratch[..n], &mut self.out)
    }
}

/// Inflate `input` into the sink's `scratch` until it is all taken or the stream ends,
/// handing the output over; the bytes of `input` taken, and whether the stream ended.
/// `crc`: the gzip member's running CRC-32 of its output.
fn inflate(
    d: &mut Decompress,
    mut input: &[u8],
    sink: &mut Sink<'_>,
    mut crc: Option<&mut Crc>,
    coding: Coding,
) -> Result<(usize, bool), DecodeError> {
    let mut taken = 0;
    loop {
        let (was_in, was_out) = (d.total_in(), d.total_out());
        let status = d
            .decompress(input, sink.scratch, FlushDecompress::None)
            .map_err(|_| DecodeError::Corrupt(coding))?;
        // Each at most its buffer's length.
        let read = (d.total_in() - was_in) as usize;
        let wrote = (d.total_out() - was_out) as usize;
        input = &input[read..];
        taken += read;
        if let Some(crc) = crc.as_deref_mut() {
            crc.update(&sink.scratch[..wrote]);
        }
        sink.pass(wrote)?;
        match status {
            Status::StreamEnd => return Ok((taken, true)),
            // No progress: inflate wants more input than there is.
            _ if read == 0 && wrote == 0 => return Ok((taken, false)),
            // Input all taken and the output not full: nothing more is pending.
            _ if input.is_empty() && wrote < sink.scratch.len() => return Ok((taken, false)),
            _ => {}
        }
    }
}

/// A gzip stream (RFC 1952): members one after the other, each a header, raw deflate
/// data, and a trailer (CRC-32 and length of its output).
struct Gzip {
    part: Member,
    /// Whether a member is complete: the stream may end after one.
    whole_member: bool,
    inflate: Decompress,
    crc: Crc,
}

impl Default for Gzip {
    fn default() -> Gzip {
        Gzip {
            part: Member::Fixed {
                read: [0; 10],
                n: 0,
            },
            whole_member: false,
            inflate: Decompress::new(false),
            crc: Crc::new(),
        }
    }
}

/// Where in a gzip member the stream is (RFC 1952 §2.3).
enum Member {
    /// The ten fixed bytes: ID1 ID2 CM FLG MTIME(4) XFL OS.
    Fixed {
        read: [u8; 10],
        n: usize,
    },
    /// FEXTRA's length (two bytes, little-endian), then its bytes.
    ExtraLength {
        flags: u8,
        low: Option<u8>,
    },
    /// FEXTRA's bytes still to skip (at least one).
    Extra {
        flags: u8,
        left: u16,
    },
    /// FNAME, then FCOMMENT: zero-terminated.
    Name {
        flags: u8,
    },
    Comment {
        flags: u8,
    },
    /// FHCRC's bytes still to skip (at least one): not checked, the trailer's CRC
    /// covers what matters.
    HeaderCrc {
        left: u8,
    },
    Data,
    /// CRC-32 and ISIZE, both little-endian.
    Trailer {
        read: [u8; 8],
        n: usize,
    },
}

const FHCRC: u8 = 1 << 1;
const FEXTRA: u8 = 1 << 2;
const FNAME: u8 = 1 << 3;
const FCOMMENT: u8 = 1 << 4;
/// Bits 5 to 7 of FLG are reserved and must be zero.
const FRESERVED: u8 = 0b1110_0000;

impl Gzip {
    fn ended(&self) -> bool {
        self.whole_member && matches!(self.part, Member::Fixed { n: 0, .. })
    }

    fn feed(&mut self, mut input: &[u8], sink: &mut Sink<'_>) -> Result<(), DecodeError> {
        let corrupt = DecodeError::Corrupt(Coding::Gzip);
        while !input.is_empty() {
            if let Member::Data = self.part {
                let (taken, ended) = inflate(
                    &mut self.inflate,
                    input,
                    sink,
                    Some(&mut self.crc),
                    Coding::Gzip,
                )?;
                if taken == 0 && !ended {
                    // Inflate took nothing it was given and did not end: it never will.
                    return Err(corrupt);
                }
                input = &input[taken..];
                if ended {
                    self.part = Member::Trailer { read: [0; 8], n: 0 };
                }
                continue;
            }
            // The header and trailer, a byte at a time: a few bytes a member.
            let b = input[0];
            input = &input[1..];
            self.part = match std::mem::replace(&mut self.part, Member::Data) {
                Member::Fixed { mut read, n } => {
                    read[n] = b;
                    // ID1, ID2 and CM (deflate) checked as they come.
                    if n < 3 && b != [0x1f, 0x8b, 8][n] {
                        return Err(corrupt);
                    }
                    if n + 1 < read.len() {
                        Member::Fixed { read, n: n + 1 }
                    } else if read[3] & FRESERVED != 0 {
                        return Err(corrupt);
                    } else {
                        Member::from(read[3], Stage::Extra)
                    }
                }
                Member::ExtraLength { flags, low: None } => Member::ExtraLength {
                    flags,
                    low: Some(b),
                },
                Member::ExtraLength {
                    flags,
                    low: Some(low),
                } => match u16::from_le_bytes([low, b]) {
                    0 => Member::from(flags, Stage::Name),
                    left => Member::Extra { flags, left },
                },
                Member::Extra { flags, left: 1 } => Member::from(flags, Stage::Name),
                Member::Extra { flags, left } => Member::Extra {
                    flags,
                    left: left - 1,
                },
                Member::Name { flags } if b == 0 => Member::from(flags, Stage::Comment),
                Member::Comment { flags } if b == 0 => Member::from(flags, Stage::HeaderCrc),
                Member::HeaderCrc { left: 1 } => Member::Data,
                Member::HeaderCrc { left } => Member::HeaderCrc { left: left - 1 },
                Member::Trailer { mut read, n } => {
                    read[n] = b;
                    if n + 1 < read.len() {
                        Member::Trailer { read, n: n + 1 }
                    } else {
                        let crc = u32::from_le_bytes([read[0], read[1], read[2], read[3]]);
                        let size = u32::from_le_bytes([read[4], read[5], read[6], read[7]]);
                        // ISIZE is the output's length modulo 2^32.
                        if crc != self.crc.sum() || size != self.crc.amount() {
                            return Err(corrupt);
                        }
                        self.whole_member = true;
                        self.inflate.reset(false);
                        self.crc.reset();
                        Member::Fixed {
                            read: [0; 10],
                            n: 0,
                        }
                    }
                }
                // A name or comment goes on; data is never read a byte at a time.
                part @ (Member::Name { .. } | Member::Comment { .. } | Member::Data) => part,
            };
        }
        Ok(())
    }
}

/// The optional parts of a gzip header, in their order.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stage {
    Extra,
    Name,
    Comment,
    HeaderCrc,
}

impl Member {
    /// The first part of the header at `stage` or after that `flags` say comes, or the
    /// data once none does.
    fn from(flags: u8, stage: Stage) -> Member {
        let wants = |at: Stage, flag: u8| stage <= at && flags & flag != 0;
        if wants(Stage::Extra, FEXTRA) {
            Member::ExtraLength { flags, low: None }
        } else if wants(Stage::Name, FNAME) {
            Member::Name { flags }
        } else if wants(Stage::Comment, FCOMMENT) {
            Member::Comment { flags }
        } else if wants(Stage::HeaderCrc, FHCRC) {
            Member::HeaderCrc { left: 2 }
        } else {
            Member::Data
        }
    }
}

/// `deflate`: zlib-wrapped as RFC 9110 says, or raw as some servers send it, told apart
/// by the first two bytes as browsers do.
#[derive(Default)]
struct Deflate {
    /// Until the first two bytes are in: the first, if it came alone.
    first: Option<u8>,
    inflate: Option<Decompress>,
    ended: bool,
}

/// Whether a stream starting `cmf`, `flg` is zlib's (RFC 1950 §2.2): compression method 8,
/// a window of at most 32 KiB, and the check bits.
fn zlib_header(cmf: u8, flg: u8) -> bool {
    cmf & 0x0f == 8 && cmf >> 4 <= 7 && (u16::from(cmf) << 8 | u16::from(flg)) % 31 == 0
}

impl Deflate {
    fn ended(&self) -> bool {
        self.ended
    }

    fn feed(&mut self, input: &[u8], sink: &mut Sink<'_>) -> Result<(), DecodeError> {
        if input.is_empty() {
            return Ok(());
        }
        if self.ended {
            return Err(DecodeError::Corrupt(Coding::Deflate));
        }
        if self.inflate.is_none() {
            let Some(first) = self.first else {
                self.first = Some(input[0]);
                return self.feed(&input[1..], sink);
            };
            let zlib = zlib_header(first, input[0]);
            self.inflate = Some(Decompress::new(zlib));
            self.feed_inflate(&[first], sink)?;
        }
        self.feed_inflate(input, sink)
    }

    fn feed_inflate(&mut self, input: &[u8], sink: &mut Sink<'_>) -> Result<(), DecodeError> {
        let Some(d) = self.inflate.as_mut() else {
            return Ok(());
        };
        let coding = Coding::Deflate;
        let (taken, ended) = inflate(d, input, sink, None, coding)?;
        if self.ended || (ended && taken < input.len()) {
            // Bytes after the stream's end.
            return Err(DecodeError::Corrupt(coding));
        }
        self.ended = ended;
        Ok(())
    }
}

/// `br`: RFC 7932's streams only (not the large-window extension).
struct Brotli {
    state: BrotliState<StandardAlloc, StandardAlloc, StandardAlloc>,
    ended: bool,
}

impl Default for Brotli {
    fn default() -> Brotli {
        Brotli {
            state: BrotliState::new_strict(
                StandardAlloc::default(),
                StandardAlloc::default(),
                StandardAlloc::default(),
            ),
            ended: false,
        }
    }
}

impl Brotli {
    fn feed(&mut self, input: &[u8], sink: &mut Sink<'_>) -> Result<(), DecodeError> {
        let corrupt = DecodeError::Corrupt(Coding::Brotli);
        if input.is_empty() {
            return Ok(());
        }
        if self.ended {
            return Err(corrupt);
        }
        let (mut available_in, mut input_offset) = (input.len(), 0);
        loop {
            let (mut available_out, mut output_offset, mut total_out) = (sink.scratch.len(), 0, 0);
            let result = BrotliDecompressStream(
                &mut available_in,
                &mut input_offset,
                input,
                &mut available_out,
                &mut output_offset,
                sink.scratch,
                &mut total_out,
                &mut self.state,
            );
            sink.pass(output_offset.min(sink.scratch.len()))?;
            match result {
                BrotliResult::NeedsMoreOutput => {}
                BrotliResult::NeedsMoreInput => return Ok(()),
                BrotliResult::ResultSuccess if available_in == 0 => {
                    self.ended = true;
                    return Ok(());
                }
                // Bytes after the stream's end, or a broken stream.
                BrotliResult::ResultSuccess | BrotliResult::ResultFailure => return Err(corrupt),
            }
        }
    }
}

#[cfg(test)]
mod tests;
