//! RFC 6455 §5 frames, scanned as they pass through: exact, bounded and streaming.
//!
//! The [`Scanner`] never buffers a payload. It keeps the header of the frame being read
//! (at most 14 bytes: 2, then 0, 2 or 8 of extended length, then 4 of masking key; §5.2)
//! and how much of the current payload is left to pass, whatever the size of the message
//! or how the stream is cut into reads. Frames are not changed: the scanner only says how
//! many bytes may pass now, how many data frames (and payload bytes) started in them,
//! which bytes are to be dropped, and where the stream breaks the protocol.
//!
//! A data frame (text, binary, continuation) passes only with its whole header: what is
//! decided from it — the size of its message, the tokens its payload takes — is decided
//! before any byte of it goes on. A header not all read yet waits for the rest
//! ([`Stop::Header`]); control frames pass as their bytes come.
//!
//! What it refuses ([`Violation`]), each a MUST of §5:
//! - a client's frame without a mask, a server's frame with one (§5.1, §5.3);
//! - a reserved opcode, 0x3-0x7 or 0xB-0xF (§5.2);
//! - a control frame (close, ping, pong) without FIN or with a payload over 125 bytes
//!   (§5.5), and a close frame whose payload is 1 byte (§5.5.1: a body starts with a
//!   2-byte code);
//! - a continuation frame with no fragmented message begun, and a new text or binary
//!   frame while one is unfinished (§5.4);
//! - a 64-bit payload length with its most significant bit set (§5.2).
//!
//! What it drops ([`Stop::Discard`]): data frames after a close frame. "After sending a
//! Close frame, the endpoint MUST NOT send any more data frames" (§5.5.1), and the
//! receiver discards what comes after a close: so does the gateway, rather than pass on
//! what the other end must not get (or fail a socket whose closing handshake is under
//! way). Control frames after a close still pass (a ping is harmless; a second close is
//! the other end's to judge).
//!
//! What it stops at: a data frame that would make its message larger than the scanner's
//! limit (`messages.max_bytes`, [`Stop::TooBig`]), and one the caller has no tokens for
//! ([`Stop::Tokens`]).
//!
//! What it lets through: the RSV bits (an extension negotiated in the handshake, such as
//! permessage-deflate, gives them a meaning the gateway need not know: a compressed
//! payload is counted as sent), non-minimal length encodings (§5.2 asks senders for the
//! minimal one; receivers lose nothing), and control frames between the fragments of a
//! message (§5.4), which are never counted: only data frames take tokens.

/// Who sends the frames scanned: a client's must be masked, a server's must not (§5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// How a stream breaks RFC 6455 §5; the text fits a close frame's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Violation(pub &'static str);

/// The tokens one [`Scanner::scan`] may spend: the data frames that may start, and the
/// payload bytes they may carry between them (a frame's whole payload is taken at its
/// header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub frames: u64,
    pub bytes: u64,
}

impl Budget {
    /// No limit: a stream no meter counts.
    pub const UNLIMITED: Budget = Budget {
        frames: u64::MAX,
        bytes: u64::MAX,
    };

    /// What is left of it once `scan` spent its share.
    pub fn after(self, scan: &Scan) -> Budget {
        Budget {
            frames: self.frames.saturating_sub(scan.frames),
            bytes: self.bytes.saturating_sub(scan.bytes),
        }
    }
}

/// What one [`Scanner::scan`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scan {
    /// Bytes from the start of the slice that may pass now.
    pub passed: usize,
    /// Data frames (text, binary, continuation) whose header is among them.
    pub frames: u64,
    /// Those frames' payload bytes (as framed: compressed where the sender compressed).
    pub bytes: u64,
    /// Why the scan ended before the end of the slice; `None`: all of it passes.
    pub stop: Option<Stop>,
}

/// Why a scan stopped at `passed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Before a data frame's header, for want of tokens: it takes one frame and `bytes`
    /// of payload. The rest waits until the caller has them.
    Tokens { bytes: u64 },
    /// Before a data frame's header that is not all read: the rest of the slice (fewer
    /// than 14 bytes) waits for the bytes after it.
    Header,
    /// The next `n` bytes (from `passed`) belong to data frames after a close frame: they
    /// are dropped, never passed. The scan goes on after them.
    Discard(usize),
    /// Before a data frame that would make its message `size` bytes, over the limit: the
    /// socket is to be closed (1009, §7.4.1), the frame never passed.
    TooBig { size: u64 },
}

/// Close status codes the gateway sends (RFC 6455 §7.4.1).
pub const GOING_AWAY: u16 = 1001;
pub const PROTOCOL_ERROR: u16 = 1002;
pub const POLICY_VIOLATION: u16 = 1008;
pub const MESSAGE_TOO_BIG: u16 = 1009;
pub const INTERNAL_ERROR: u16 = 1011;

/// The longest header: 2 bytes, 8 of extended length, 4 of masking key.
pub const MAX_HEADER: usize = 14;
/// A control frame's longest payload (§5.5); a close frame's reason gets 2 bytes less.
const MAX_CONTROL_PAYLOAD: u64 = 125;
const MAX_CLOSE_REASON: usize = 123;

const FIN: u8 = 0x80;
const MASK: u8 = 0x80;
const OPCODE: u8 = 0x0F;
const CONTINUATION: u8 = 0x0;
const TEXT: u8 = 0x1;
const BINARY: u8 = 0x2;
const CLOSE: u8 = 0x8;

/// One direction of a WebSocket, scanned frame by frame as its bytes pass.
#[derive(Debug, Clone, Copy)]
pub struct Scanner {
    side: Side,
    /// The header of the control frame being read, as far as it has come (a data
    /// frame's is read whole, from the stream).
    header: [u8; MAX_HEADER],
    /// Header bytes read so far: 0 between frames and inside a payload.
    have: u8,
    /// Payload bytes of the current frame still to pass (or to drop).
    left: u64,
    /// The current frame's payload is dropped, not passed: a data frame after a close.
    dropping: bool,
    /// A text or binary frame without FIN began a message that is not finished: only
    /// continuations (and control frames) may come until one with FIN.
    fragmented: bool,
    /// A close frame was seen: data frames after it are dropped (§5.5.1).
    closed: bool,
    /// The payload bytes of the message being read (or last read), its frames summed.
    message: u64,
    /// The largest message allowed, in payload bytes (`u64::MAX`: no limit).
    max_message: u64,
    /// The first violation: the stream is not scanned past it.
    failed: Option<Violation>,
}

fn is_data(opcode: u8) -> bool {
    matches!(opcode, CONTINUATION | TEXT | BINARY)
}

fn is_control(opcode: u8) -> bool {
    opcode & 0x8 != 0
}

/// What the scanner makes of a data frame's header at the front of a slice.
enum DataHeader {
    /// Not all here yet.
    Partial,
    /// It stops the scan here.
    Stop(Stop),
    /// It passes: `len` header bytes, then `payload` bytes.
    Pass { len: usize, payload: u64 },
    /// It is dropped, header and payload.
    Drop { len: usize, payload: u64 },
}

impl Scanner {
    pub fn new(side: Side) -> Scanner {
        Scanner {
            side,
            header: [0; MAX_HEADER],
            have: 0,
            left: 0,
            dropping: false,
            fragmented: false,
            closed: false,
            message: 0,
            max_message: u64::MAX,
            failed: None,
        }
    }

    /// The same scanner, stopping at a message (a data frame with its fragments) of more
    /// than `max` payload bytes ([`Stop::TooBig`]).
    pub fn with_max_message(self, max: u64) -> Scanner {
        Scanner {
            max_message: max,
            ..self
        }
    }

    /// Scan the next bytes of the stream, spending at most `budget`: stops *before* a
    /// data frame (text, binary, continuation) whose frame or payload bytes the budget no
    /// longer holds; control frames pass without tokens. Returns how many bytes may pass
    /// now, how many data frames (and payload bytes) started in them, and why it stopped
    /// short, if it did ([`Stop`]): the caller passes `bytes[..passed]`, acts on the stop
    /// (drops the bytes of a [`Stop::Discard`], finds tokens, reads more, closes), and
    /// scans the rest again.
    ///
    /// A violation anywhere in `bytes` fails the whole call: none of `bytes` is to pass
    /// (the connection is failed, §7.1.7), the scanner stays where it was before the call
    /// (so [`Scanner::at_boundary`] still tells whether what already passed ends between
    /// frames), and every later call returns the same violation.
    pub fn scan(&mut self, bytes: &[u8], budget: Budget) -> Result<Scan, Violation> {
        if let Some(v) = self.failed {
            return Err(v);
        }
        let before = *self;
        self.run(bytes, budget).inspect_err(|&v| {
            *self = before;
            self.failed = Some(v);
        })
    }

    /// Whether the stream is between frames: a frame injected now (a close) is well
    /// formed. Inside a fragmented message too: control frames may come between its
    /// fragments (§5.4).
    pub fn at_boundary(&self) -> bool {
        self.have == 0 && self.left == 0
    }

    /// Whether a close frame has begun to pass: the sender has started the closing
    /// handshake (§5.5.1), so it must not get a second close frame from the gateway.
    pub fn closed(&self) -> bool {
        self.closed
    }

    fn run(&mut self, bytes: &[u8], budget: Budget) -> Result<Scan, Violation> {
        let mut scan = Scan {
            passed: 0,
            frames: 0,
            bytes: 0,
            stop: None,
        };
        let mut i = 0;
        while i < bytes.len() {
            if self.left > 0 {
                // Payload: skipped whole, never looked at.
                let n = self.take_payload(bytes.len() - i);
                if self.dropping {
                    // Only ever at the start of a call: a drop ends the call it begins in.
                    self.dropping = self.left > 0;
                    return Ok(Scan {
                        passed: i,
                        stop: Some(Stop::Discard(n)),
                        ..scan
                    });
                }
                i += n;
                continue;
            }
            let b = bytes[i];
            if self.have == 0 && is_data(b & OPCODE) {
                let stop = |stop| Scan {
                    passed: i,
                    stop: Some(stop),
                    ..scan
                };
                match self.data_header(&bytes[i..], budget.after(&scan))? {
                    DataHeader::Partial => return Ok(stop(Stop::Header)),
                    DataHeader::Stop(s) => return Ok(stop(s)),
                    DataHeader::Pass { len, payload } => {
                        scan.frames += 1;
                        scan.bytes += payload;
                        self.left = payload;
                        i += len;
                    }
                    DataHeader::Drop { len, payload } => {
                        self.left = payload;
                        let n = self.take_payload(bytes.len() - i - len);
                        self.dropping = self.left > 0;
                        return Ok(stop(Stop::Discard(len + n)));
                    }
                }
                continue;
            }
            // A control frame: its whole header at hand (as it nearly always is) taken at
            // once, checked as the byte-at-a-time path below checks it.
            if self.have == 0 {
                if let Some(&second) = bytes.get(i + 1) {
                    let len = header_len(second);
                    if let Some(header) = bytes.get(i..i + len) {
                        self.first_byte(b)?;
                        self.second_byte(second)?;
                        self.header[..len].copy_from_slice(header);
                        self.end_header()?;
                        i += len;
                        continue;
                    }
                }
            }
            self.header_byte(b)?;
            i += 1;
        }
        scan.passed = i;
        Ok(scan)
    }

    /// Up to `at_most` bytes of the current payload, taken: how many.
    fn take_payload(&mut self, at_most: usize) -> usize {
        let n = usize::try_from(self.left).map_or(at_most, |l| l.min(at_most));
        self.left -= n as u64;
        n
    }

    /// A data frame's header at the front of `bytes`: checked, then passed (its message's
    /// size and its tokens allowing), stopped at, or dropped after a close.
    fn data_header(&mut self, bytes: &[u8], budget: Budget) -> Result<DataHeader, Violation> {
        let first = bytes[0];
        let (fin, opcode) = (first & FIN != 0, first & OPCODE);
        if !self.closed {
            match opcode {
                CONTINUATION if !self.fragmented => {
                    return Err(Violation("continuation frame outside a fragmented message"))
                }
                TEXT | BINARY if self.fragmented => {
                    return Err(Violation(
                        "new message inside an unfinished fragmented message",
                    ))
                }
                _ => {}
            }
        }
        let Some(&second) = bytes.get(1) else {
            return Ok(DataHeader::Partial);
        };
        self.second_byte(second)?;
        let len = header_len(second);
        let Some(header) = bytes.get(..len) else {
            return Ok(DataHeader::Partial);
        };
        let payload = payload_len(header)?;
        if self.closed {
            return Ok(DataHeader::Drop { len, payload });
        }
        let size = match opcode {
            CONTINUATION => self.message.saturating_add(payload),
            _ => payload,
        };
        if size > self.max_message {
            return Ok(DataHeader::Stop(Stop::TooBig { size }));
        }
        if budget.frames == 0 || payload > budget.bytes {
            return Ok(DataHeader::Stop(Stop::Tokens { bytes: payload }));
        }
        self.fragmented = !fin;
        self.message = size;
        Ok(DataHeader::Pass { len, payload })
    }

    /// One more byte of the current (control) frame's header.
    fn header_byte(&mut self, b: u8) -> Result<(), Violation> {
        let at = usize::from(self.have);
        self.header[at] = b;
        self.have += 1;
        match at {
            0 => self.first_byte(b)?,
            1 => self.second_byte(b)?,
            _ => {}
        }
        if at >= 1 && usize::from(self.have) == header_len(self.header[1]) {
            self.end_header()?;
        }
        Ok(())
    }

    /// FIN, RSV1-3 (passed as they are), opcode of a frame that is not a data frame
    /// (those are read by `data_header`): is it allowed?
    fn first_byte(&mut self, b: u8) -> Result<(), Violation> {
        let fin = b & FIN != 0;
        match b & OPCODE {
            0x8..=0xA if !fin => Err(Violation("fragmented control frame")),
            CLOSE => {
                self.closed = true;
                Ok(())
            }
            0x9 | 0xA => Ok(()),
            _ => Err(Violation("reserved opcode")),
        }
    }

    /// MASK and the 7-bit length.
    fn second_byte(&mut self, b: u8) -> Result<(), Violation> {
        match (self.side, b & MASK != 0) {
            (Side::Client, false) => Err(Violation("unmasked frame from the client")),
            (Side::Server, true) => Err(Violation("masked frame from the server")),
            _ => Ok(()),
        }
    }

    /// The control frame's header is complete: its payload length, checked; the payload
    /// comes next.
    fn end_header(&mut self) -> Result<(), Violation> {
        let len = payload_len(&self.header)?;
        let opcode = self.header[0] & OPCODE;
        if is_control(opcode) && len > MAX_CONTROL_PAYLOAD {
            return Err(Violation("control frame payload over 125 bytes"));
        }
        if opcode == CLOSE && len == 1 {
            return Err(Violation("close frame with a 1-byte payload"));
        }
        self.have = 0;
        self.left = len;
        Ok(())
    }
}

/// A frame header's full length, from its second byte (MASK and the 7-bit length).
fn header_len(second: u8) -> usize {
    let extended = match second & 0x7F {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    let mask = if second & MASK != 0 { 4 } else { 0 };
    2 + extended + mask
}

/// The payload length a whole header gives (§5.2).
fn payload_len(h: &[u8]) -> Result<u64, Violation> {
    Ok(match h[1] & 0x7F {
        126 => u64::from(u16::from_be_bytes([h[2], h[3]])),
        127 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[2..10]);
            let len = u64::from_be_bytes(b);
            if len >> 63 != 0 {
                return Err(Violation(
                    "64-bit payload length with the most significant bit set",
                ));
            }
            len
        }
        n => u64::from(n),
    })
}

/// A close frame (§5.5.1) with `code` and `reason`, cut to 123 bytes on a character
/// boundary (a control frame's payload is at most 125 bytes). `mask`: the masking key, for
/// a frame the gateway sends to a server as if from the client (§5.3); `None` toward a
/// client.
pub fn close_frame(code: u16, reason: &str, mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut cut = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let reason = &reason.as_bytes()[..cut];
    let len = 2 + reason.len();
    let mut frame = Vec::with_capacity(2 + 4 + len);
    frame.push(FIN | CLOSE);
    // At most 125: the 7-bit length.
    frame.push(len as u8 | if mask.is_some() { MASK } else { 0 });
    if let Some(key) = mask {
        frame.extend_from_slice(&key);
    }
    let start = frame.len();
    frame.extend_from_slice(&code.to_be_bytes());
    frame.extend_from_slice(reason);
    if let Some(key) = mask {
        for (i, b) in frame[start..].iter_mut().enumerate() {
            *b ^= key[i % 4];
        }
    }
    frame
}

#[cfg(test)]
mod tests;
