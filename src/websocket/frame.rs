//! RFC 6455 §5 frames, scanned as they pass through: exact, bounded and streaming.
//!
//! The [`Scanner`] never buffers a payload. It keeps the header of the frame being read
//! (at most 14 bytes: 2, then 0, 2 or 8 of extended length, then 4 of masking key; §5.2)
//! and how much of the current payload is left to pass, whatever the size of the message
//! or how the stream is cut into reads. Frames are not changed: the scanner only says how
//! many bytes may pass now, how many data frames started in them, and where the stream
//! breaks the protocol.
//!
//! What it refuses ([`Violation`]), each a MUST of §5:
//! - a client's frame without a mask, a server's frame with one (§5.1, §5.3);
//! - a reserved opcode, 0x3-0x7 or 0xB-0xF (§5.2);
//! - a control frame (close, ping, pong) without FIN or with a payload over 125 bytes
//!   (§5.5), and a close frame whose payload is 1 byte (§5.5.1: a body starts with a
//!   2-byte code);
//! - a continuation frame with no fragmented message begun, and a new text or binary
//!   frame while one is unfinished (§5.4);
//! - a 64-bit payload length with its most significant bit set (§5.2);
//! - a data frame after a close frame (§5.5.1).
//!
//! What it lets through: the RSV bits (an extension negotiated in the handshake, such as
//! permessage-deflate, gives them a meaning the gateway need not know), non-minimal
//! length encodings (§5.2 asks senders for the minimal one; receivers lose nothing), and
//! control frames between the fragments of a message (§5.4), which are never counted:
//! only data frames (text, binary, continuation) take tokens.

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

/// What one [`Scanner::scan`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scan {
    /// Bytes from the start of the slice that may pass now.
    pub passed: usize,
    /// Data frames (text, binary, continuation) whose first byte is among them.
    pub frames: u64,
    /// The scan stopped before the first byte of a data frame for want of a token: the
    /// rest of the slice waits for more.
    pub blocked: bool,
}

/// Close status codes the gateway sends (RFC 6455 §7.4.1).
pub const GOING_AWAY: u16 = 1001;
pub const PROTOCOL_ERROR: u16 = 1002;
pub const POLICY_VIOLATION: u16 = 1008;
pub const INTERNAL_ERROR: u16 = 1011;

/// The longest header: 2 bytes, 8 of extended length, 4 of masking key.
const MAX_HEADER: usize = 14;
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
    /// The header of the frame being read, as far as it has come.
    header: [u8; MAX_HEADER],
    /// Header bytes read so far: 0 between frames and inside a payload.
    have: u8,
    /// Payload bytes of the current frame still to pass.
    left: u64,
    /// A text or binary frame without FIN began a message that is not finished: only
    /// continuations (and control frames) may come until one with FIN.
    fragmented: bool,
    /// A close frame was seen: no data frame may follow it (§5.5.1).
    closed: bool,
    /// The first violation: the stream is not scanned past it.
    failed: Option<Violation>,
}

fn is_data(opcode: u8) -> bool {
    matches!(opcode, CONTINUATION | TEXT | BINARY)
}

fn is_control(opcode: u8) -> bool {
    opcode & 0x8 != 0
}

impl Scanner {
    pub fn new(side: Side) -> Scanner {
        Scanner {
            side,
            header: [0; MAX_HEADER],
            have: 0,
            left: 0,
            fragmented: false,
            closed: false,
            failed: None,
        }
    }

    /// Scan the next bytes of the stream. Stops *before the first byte* of a data frame
    /// (text, binary, continuation) once `tokens` data frames have started in this call;
    /// control frames pass without tokens. Returns how many bytes may pass now, how many
    /// data frames started in them, and whether it stopped for want of a token: the
    /// caller passes `bytes[..passed]` and scans the rest again, from `passed`, once it
    /// has tokens.
    ///
    /// A violation anywhere in `bytes` fails the whole call: none of `bytes` is to pass
    /// (the connection is failed, §7.1.7), the scanner stays where it was before the call
    /// (so [`Scanner::at_boundary`] still tells whether what already passed ends between
    /// frames), and every later call returns the same violation.
    pub fn scan(&mut self, bytes: &[u8], tokens: u64) -> Result<Scan, Violation> {
        if let Some(v) = self.failed {
            return Err(v);
        }
        let before = *self;
        self.run(bytes, tokens).inspect_err(|&v| {
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

    fn run(&mut self, bytes: &[u8], tokens: u64) -> Result<Scan, Violation> {
        let mut i = 0;
        let mut frames = 0;
        while i < bytes.len() {
            if self.left > 0 {
                // Payload: skipped whole, never looked at.
                let n =
                    usize::try_from(self.left).map_or(bytes.len() - i, |l| l.min(bytes.len() - i));
                i += n;
                self.left -= n as u64;
                continue;
            }
            let b = bytes[i];
            if self.have == 0 {
                if is_data(b & OPCODE) {
                    if frames >= tokens {
                        return Ok(Scan {
                            passed: i,
                            frames,
                            blocked: true,
                        });
                    }
                    frames += 1;
                }
                // The whole header at hand (as it nearly always is): taken at once, checked
                // as the byte-at-a-time path below checks it.
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
        Ok(Scan {
            passed: i,
            frames,
            blocked: false,
        })
    }

    /// One more byte of the current frame's header.
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

    /// FIN, RSV1-3 (passed as they are), opcode: is this frame allowed here?
    fn first_byte(&mut self, b: u8) -> Result<(), Violation> {
        let fin = b & FIN != 0;
        let opcode = b & OPCODE;
        match opcode {
            CONTINUATION | TEXT | BINARY if self.closed => {
                return Err(Violation("data frame after a close frame"))
            }
            CONTINUATION if !self.fragmented => {
                return Err(Violation("continuation frame outside a fragmented message"))
            }
            CONTINUATION => self.fragmented = !fin,
            TEXT | BINARY if self.fragmented => {
                return Err(Violation(
                    "new message inside an unfinished fragmented message",
                ))
            }
            TEXT | BINARY => self.fragmented = !fin,
            0x8..=0xA if !fin => return Err(Violation("fragmented control frame")),
            CLOSE => self.closed = true,
            0x9 | 0xA => {}
            _ => return Err(Violation("reserved opcode")),
        }
        Ok(())
    }

    /// MASK and the 7-bit length.
    fn second_byte(&mut self, b: u8) -> Result<(), Violation> {
        match (self.side, b & MASK != 0) {
            (Side::Client, false) => Err(Violation("unmasked frame from the client")),
            (Side::Server, true) => Err(Violation("masked frame from the server")),
            _ => Ok(()),
        }
    }

    /// The header is complete: its payload length, checked; the payload comes next.
    fn end_header(&mut self) -> Result<(), Violation> {
        let h = &self.header;
        let len = match h[1] & 0x7F {
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
        };
        let opcode = h[0] & OPCODE;
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// How a frame writes its payload length (§5.2): the 7-bit form where it fits, or
    /// the 16- or 64-bit form whatever the length (non-minimal encodings pass).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Width {
        Minimal,
        Bits16,
        Bits64,
    }

    /// One frame to write: its first byte (FIN, RSV, opcode), payload length and width.
    #[derive(Debug, Clone, Copy)]
    struct F {
        fin: bool,
        rsv: u8,
        opcode: u8,
        len: usize,
        width: Width,
    }

    fn f(fin: bool, opcode: u8, len: usize) -> F {
        F {
            fin,
            rsv: 0,
            opcode,
            len,
            width: Width::Minimal,
        }
    }

    /// `frame` as `side` sends it: masked from a client, with a payload that looks like
    /// frame headers (the scanner must never read a payload).
    fn write(frame: F, side: Side, out: &mut Vec<u8>) {
        out.push(u8::from(frame.fin) << 7 | frame.rsv << 4 | frame.opcode);
        let mask = if side == Side::Client { MASK } else { 0 };
        let len = frame.len as u64;
        match frame.width {
            Width::Minimal if len <= 125 => out.push(mask | len as u8),
            Width::Minimal if len <= 0xFFFF => {
                out.push(mask | 126);
                out.extend_from_slice(&(len as u16).to_be_bytes());
            }
            Width::Bits16 if len <= 0xFFFF => {
                out.push(mask | 126);
                out.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                out.push(mask | 127);
                out.extend_from_slice(&len.to_be_bytes());
            }
        }
        if side == Side::Client {
            out.extend_from_slice(&[0x37, 0xFA, 0x21, 0x3D]);
        }
        out.extend((0..frame.len).map(|i| [0x81, 0x00, 0x89, 0xFF][i % 4]));
    }

    fn bytes(frames: &[F], side: Side) -> Vec<u8> {
        let mut out = Vec::new();
        for &fr in frames {
            write(fr, side, &mut out);
        }
        out
    }

    /// Everything scanned in one call with tokens to spare.
    fn scan_all(side: Side, stream: &[u8]) -> Result<Scan, Violation> {
        Scanner::new(side).scan(stream, u64::MAX)
    }

    fn refused(side: Side, frames: &[F]) -> &'static str {
        match scan_all(side, &bytes(frames, side)) {
            Err(Violation(why)) => why,
            Ok(s) => panic!("{frames:?} passed: {s:?}"),
        }
    }

    #[test]
    fn seven_sixteen_and_sixty_four_bit_lengths_are_read_exactly() {
        for side in [Side::Client, Side::Server] {
            for len in [0, 1, 125, 126, 127, 65_535, 65_536, 70_000] {
                for width in [Width::Minimal, Width::Bits16, Width::Bits64] {
                    let fr = F {
                        width,
                        ..f(true, BINARY, len)
                    };
                    let stream = bytes(&[fr, f(true, TEXT, 3)], side);
                    let mut s = Scanner::new(side);
                    // The second frame starts exactly after the first one's payload.
                    let first = stream.len() - bytes(&[f(true, TEXT, 3)], side).len();
                    let one = s.scan(&stream[..first], u64::MAX).unwrap();
                    assert_eq!((one.passed, one.frames), (first, 1), "{len} {width:?}");
                    assert!(s.at_boundary(), "{len} {width:?}");
                    let two = s.scan(&stream[first..], 0).unwrap();
                    assert_eq!((two.passed, two.frames, two.blocked), (0, 0, true));
                }
            }
        }
    }

    #[test]
    fn a_64_bit_length_with_its_top_bit_set_is_refused() {
        let mut stream = vec![FIN | BINARY, 127];
        stream.extend_from_slice(&(1u64 << 63 | 5).to_be_bytes());
        assert_eq!(
            scan_all(Side::Server, &stream),
            Err(Violation(
                "64-bit payload length with the most significant bit set"
            ))
        );
        // The largest allowed length is read, and its payload waited for.
        let mut stream = vec![FIN | BINARY, 127];
        stream.extend_from_slice(&(u64::MAX >> 1).to_be_bytes());
        stream.extend_from_slice(&[0; 100]);
        let mut s = Scanner::new(Side::Server);
        assert_eq!(s.scan(&stream, 1).unwrap().passed, stream.len());
        assert!(!s.at_boundary());
    }

    #[test]
    fn a_client_must_mask_and_a_server_must_not() {
        let unmasked = bytes(&[f(true, TEXT, 2)], Side::Server);
        assert_eq!(
            scan_all(Side::Client, &unmasked),
            Err(Violation("unmasked frame from the client"))
        );
        let masked = bytes(&[f(true, TEXT, 2)], Side::Client);
        assert_eq!(
            scan_all(Side::Server, &masked),
            Err(Violation("masked frame from the server"))
        );
        assert!(scan_all(Side::Client, &masked).is_ok());
        assert!(scan_all(Side::Server, &unmasked).is_ok());
    }

    #[test]
    fn reserved_opcodes_are_refused() {
        for op in (0x3..=0x7).chain(0xB..=0xF) {
            for fin in [true, false] {
                assert_eq!(
                    refused(Side::Client, &[f(fin, op, 0)]),
                    "reserved opcode",
                    "{op:#x}"
                );
            }
        }
    }

    #[test]
    fn control_frames_are_short_and_whole() {
        for op in [0x8, 0x9, 0xA] {
            assert_eq!(
                refused(Side::Client, &[f(false, op, 2)]),
                "fragmented control frame"
            );
            assert_eq!(
                refused(Side::Server, &[f(true, op, 126)]),
                "control frame payload over 125 bytes"
            );
            // 125 is allowed, in any width.
            for width in [Width::Minimal, Width::Bits16, Width::Bits64] {
                let fr = F {
                    width,
                    ..f(true, op, 125)
                };
                assert!(scan_all(Side::Server, &bytes(&[fr], Side::Server)).is_ok());
            }
        }
        assert_eq!(
            refused(Side::Client, &[f(true, CLOSE, 1)]),
            "close frame with a 1-byte payload"
        );
        assert!(scan_all(Side::Client, &bytes(&[f(true, CLOSE, 0)], Side::Client)).is_ok());
    }

    #[test]
    fn fragments_follow_their_message_and_controls_may_come_between() {
        let message = [
            f(false, TEXT, 10),
            f(true, 0x9, 4),
            f(false, CONTINUATION, 0),
            f(true, 0xA, 0),
            f(true, 0x9, 0),
            f(true, CONTINUATION, 7),
            f(true, BINARY, 1),
        ];
        let scan = scan_all(Side::Client, &bytes(&message, Side::Client)).unwrap();
        assert_eq!(scan.frames, 4, "the pings and the pong are not counted");
        assert_eq!(
            refused(Side::Client, &[f(true, CONTINUATION, 1)]),
            "continuation frame outside a fragmented message"
        );
        assert_eq!(
            refused(Side::Client, &[f(true, TEXT, 1), f(true, CONTINUATION, 1)]),
            "continuation frame outside a fragmented message"
        );
        assert_eq!(
            refused(Side::Client, &[f(false, BINARY, 1), f(true, TEXT, 1)]),
            "new message inside an unfinished fragmented message"
        );
        assert_eq!(
            refused(Side::Server, &[f(true, CLOSE, 2), f(true, TEXT, 1)]),
            "data frame after a close frame"
        );
        // A ping after a close is no data frame.
        assert!(scan_all(
            Side::Server,
            &bytes(&[f(true, CLOSE, 2), f(true, 0x9, 1)], Side::Server)
        )
        .is_ok());
    }

    #[test]
    fn rsv_bits_pass() {
        for rsv in 0..8 {
            let fr = F {
                rsv,
                ..f(true, TEXT, 5)
            };
            assert!(scan_all(Side::Client, &bytes(&[fr], Side::Client)).is_ok());
        }
    }

    #[test]
    fn tokens_stop_the_scan_before_a_data_frame_and_control_frames_need_none() {
        let frames = [
            f(true, 0x9, 3),
            f(true, TEXT, 2),
            f(true, 0xA, 0),
            f(true, BINARY, 4),
        ];
        let stream = bytes(&frames, Side::Client);
        let ping = bytes(&frames[..1], Side::Client).len();
        let then_pong = bytes(&frames[..3], Side::Client).len();
        let mut s = Scanner::new(Side::Client);
        let a = s.scan(&stream, 0).unwrap();
        assert_eq!((a.passed, a.frames, a.blocked), (ping, 0, true));
        assert!(s.at_boundary());
        let b = s.scan(&stream[a.passed..], 1).unwrap();
        assert_eq!((b.passed, b.frames, b.blocked), (then_pong - ping, 1, true));
        let c = s.scan(&stream[then_pong..], 5).unwrap();
        assert_eq!(
            (c.passed, c.frames, c.blocked),
            (stream.len() - then_pong, 1, false)
        );
        assert!(s.at_boundary());
        // Nothing to scan: nothing blocked.
        assert_eq!(
            s.scan(&[], 0).unwrap(),
            Scan {
                passed: 0,
                frames: 0,
                blocked: false
            }
        );
    }

    #[test]
    fn a_frame_counts_where_its_first_byte_passes() {
        let stream = bytes(&[f(true, TEXT, 300)], Side::Client);
        let mut s = Scanner::new(Side::Client);
        assert_eq!(s.scan(&stream[..1], 1).unwrap().frames, 1);
        assert!(!s.at_boundary());
        // The rest of the frame (header and payload) needs no token.
        let rest = s.scan(&stream[1..], 0).unwrap();
        assert_eq!((rest.passed, rest.frames), (stream.len() - 1, 0));
        assert!(s.at_boundary());
    }

    #[test]
    fn a_violation_passes_nothing_of_its_call_and_sticks() {
        let good = bytes(&[f(false, TEXT, 3)], Side::Client);
        let mut stream = good.clone();
        stream.extend(bytes(&[f(true, TEXT, 3)], Side::Client));
        let mut s = Scanner::new(Side::Client);
        assert!(s.scan(&good[..4], 9).is_ok());
        let why = s.scan(&stream[4..], 9).unwrap_err();
        assert_eq!(why.0, "new message inside an unfinished fragmented message");
        // Still where it was: inside the first frame's header.
        assert!(!s.at_boundary());
        assert_eq!(s.scan(&[], 9), Err(why));
        assert_eq!(why.to_string(), why.0);
    }

    #[test]
    fn a_1_mib_fragmented_message_scans_in_constant_memory() {
        // All the scanner ever holds: no payload, no buffer that grows.
        assert!(std::mem::size_of::<Scanner>() <= 64);
        let mut s = Scanner::new(Side::Client);
        let zeros = [0u8; 4096];
        let fragment = 64 * 1024;
        let mut frames = 0;
        for i in 0..16 {
            let opcode = if i == 0 { TEXT } else { CONTINUATION };
            let mut header = Vec::new();
            write(f(i == 15, opcode, 0), Side::Client, &mut header);
            // The same header with the 64-bit length of a 64 KiB fragment.
            header[1] = MASK | 127;
            header.splice(2..2, (fragment as u64).to_be_bytes());
            let scan = s.scan(&header, 1).unwrap();
            assert_eq!(scan.passed, header.len());
            frames += scan.frames;
            for _ in 0..fragment / zeros.len() {
                let scan = s.scan(&zeros, 0).unwrap();
                assert_eq!((scan.passed, scan.blocked), (zeros.len(), false));
            }
            assert!(s.at_boundary());
            if i == 7 {
                // A ping between fragments.
                let ping = bytes(&[f(true, 0x9, 125)], Side::Client);
                assert_eq!(s.scan(&ping, 0).unwrap().passed, ping.len());
            }
        }
        assert_eq!(frames, 16);
        // The message is finished: a new one may begin.
        let next = bytes(&[f(true, BINARY, 1)], Side::Client);
        assert_eq!(s.scan(&next, 1).unwrap().frames, 1);
    }

    #[test]
    fn close_frames_carry_their_code_and_a_cut_reason() {
        let plain = close_frame(POLICY_VIOLATION, "too many messages", None);
        assert_eq!(plain[..4], [FIN | CLOSE, 19, 0x03, 0xF0]);
        assert_eq!(&plain[4..], b"too many messages");
        let s = scan_all(Side::Server, &plain).unwrap();
        assert_eq!((s.passed, s.frames), (plain.len(), 0));

        // 122 ASCII bytes then a 2-byte character: cut before it, at 122.
        let reason = format!("{}é and more", "x".repeat(122));
        let cut = close_frame(GOING_AWAY, &reason, None);
        assert_eq!(cut[1], 2 + 122);
        assert_eq!(&cut[4..], "x".repeat(122).as_bytes());
        let long = close_frame(GOING_AWAY, &"y".repeat(500), None);
        assert_eq!((long[1], long.len()), (125, 127));

        let key = [0xA1, 0x02, 0xF3, 0x44];
        let masked = close_frame(PROTOCOL_ERROR, "bye", Some(key));
        assert_eq!(masked[..2], [FIN | CLOSE, MASK | 5]);
        assert_eq!(masked[2..6], key);
        let payload: Vec<u8> = masked[6..]
            .iter()
            .enumerate()
            .map(|(i, b)| b ^ key[i % 4])
            .collect();
        assert_eq!(payload, [0x03, 0xEA, b'b', b'y', b'e']);
        let mut s = Scanner::new(Side::Client);
        assert_eq!(s.scan(&masked, 0).unwrap().passed, masked.len());
        assert!(s.closed() && s.at_boundary());
        assert_eq!(
            close_frame(INTERNAL_ERROR, "", None),
            [FIN | CLOSE, 2, 0x03, 0xF3]
        );
    }

    /// A valid stream: messages of 1 to 4 fragments, control frames between them and
    /// between fragments, lengths in every width; perhaps a close at the end.
    fn valid_frames() -> impl Strategy<Value = Vec<F>> {
        let width = prop_oneof![
            4 => Just(Width::Minimal),
            1 => Just(Width::Bits16),
            1 => Just(Width::Bits64),
        ];
        let len = prop_oneof![
            4 => 0usize..=125,
            2 => 126usize..=70_000,
        ];
        let data = (len.clone(), width.clone(), 0u8..8);
        let control = (prop_oneof![Just(0x9u8), Just(0xA)], 0usize..=125, width);
        let piece = (data, proptest::option::weighted(0.3, control));
        let message = (
            prop_oneof![Just(TEXT), Just(BINARY)],
            proptest::collection::vec(piece, 1..=4),
        );
        (
            proptest::collection::vec(message, 0..6),
            proptest::bool::weighted(0.3),
        )
            .prop_map(|(messages, close)| {
                let mut frames = Vec::new();
                for (opcode, pieces) in messages {
                    let last = pieces.len() - 1;
                    for (i, ((len, width, rsv), control)) in pieces.into_iter().enumerate() {
                        frames.push(F {
                            fin: i == last,
                            rsv,
                            opcode: if i == 0 { opcode } else { CONTINUATION },
                            len,
                            width,
                        });
                        if let Some((op, len, width)) = control {
                            frames.push(F {
                                width,
                                ..f(true, op, len)
                            });
                        }
                    }
                }
                if close {
                    frames.push(f(true, CLOSE, 2));
                }
                frames
            })
    }

    /// Where each frame of `frames` starts in the stream, whether it is a data frame,
    /// and the stream's length.
    fn layout(frames: &[F], side: Side) -> (Vec<(usize, bool)>, usize) {
        let mut starts = Vec::new();
        let mut at = 0;
        for &fr in frames {
            starts.push((at, is_data(fr.opcode)));
            let mut one = Vec::new();
            write(fr, side, &mut one);
            at += one.len();
        }
        (starts, at)
    }

    fn side() -> impl Strategy<Value = Side> {
        prop_oneof![Just(Side::Client), Just(Side::Server)]
    }

    crate::proptest_seeds! {
        #![cases(300)]

        /// However a valid stream is cut into reads, every byte passes, every data frame
        /// is counted once, and the scanner is at a boundary exactly between frames.
        #[test]
        fn any_split_gives_the_same_counts_and_boundaries(
            frames in valid_frames(),
            side in side(),
            cuts in proptest::collection::vec(0.0f64..1.0, 0..12),
        ) {
            let stream = bytes(&frames, side);
            let (starts, end) = layout(&frames, side);
            let mut cuts: Vec<usize> = cuts.iter().map(|c| (c * end as f64) as usize).collect();
            cuts.push(end);
            cuts.sort_unstable();
            let mut s = Scanner::new(side);
            let (mut at, mut counted) = (0, 0);
            for cut in cuts {
                let scan = s.scan(&stream[at..cut], u64::MAX).map_err(|v| TestCaseError::fail(v.0))?;
                prop_assert_eq!(scan.passed, cut - at);
                prop_assert!(!scan.blocked);
                counted += scan.frames;
                at = cut;
                let between = at == end || starts.iter().any(|&(st, _)| st == at);
                prop_assert_eq!(s.at_boundary(), between, "at {}", at);
            }
            let data = starts.iter().filter(|(_, d)| *d).count() as u64;
            prop_assert_eq!(counted, data);
        }

        /// With few tokens a call, the scan stops exactly at data frames' first bytes and
        /// counts exactly the data frames it let start.
        #[test]
        fn tokens_stop_exactly_at_data_frames(
            frames in valid_frames(),
            side in side(),
            reads in proptest::collection::vec((1usize..5_000, 0u64..3), 1..40),
        ) {
            let stream = bytes(&frames, side);
            let (starts, end) = layout(&frames, side);
            let mut s = Scanner::new(side);
            let (mut at, mut counted, mut turn) = (0, 0, 0);
            while at < end {
                let (len, tokens) = reads[turn % reads.len()];
                // Every few turns, tokens to spare: the stream always moves on.
                let tokens = if turn % reads.len() == reads.len() - 1 { tokens + 1 } else { tokens };
                turn += 1;
                prop_assert!(turn < 10_000_000, "no progress at {}", at);
                let upto = (at + len).min(end);
                let scan = s.scan(&stream[at..upto], tokens).map_err(|v| TestCaseError::fail(v.0))?;
                let started = starts
                    .iter()
                    .filter(|&&(st, d)| d && st >= at && st < at + scan.passed)
                    .count() as u64;
                prop_assert_eq!(scan.frames, started);
                prop_assert!(scan.frames <= tokens);
                if scan.blocked {
                    prop_assert_eq!(scan.frames, tokens);
                    let stop = at + scan.passed;
                    prop_assert!(starts.contains(&(stop, true)), "blocked at {} mid-frame", stop);
                } else {
                    prop_assert_eq!(scan.passed, upto - at);
                }
                counted += scan.frames;
                at += scan.passed;
            }
            prop_assert_eq!(counted, starts.iter().filter(|(_, d)| *d).count() as u64);
            prop_assert!(s.at_boundary());
        }
    }
}
