//! The few pieces of RFC 6455 the benchmark needs: the opening handshake's accept value
//! (§4.2.2) and frames (§5.2), each read and written whole; a client's are masked (§5.3),
//! a server's are not.

use base64::Engine;

pub const CONTINUATION: u8 = 0x0;
pub const TEXT: u8 = 0x1;
pub const BINARY: u8 = 0x2;
pub const CLOSE: u8 = 0x8;
pub const PING: u8 = 0x9;
pub const PONG: u8 = 0xA;

/// The GUID a server appends to the client's key (§1.3).
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// `Sec-WebSocket-Accept` for a `Sec-WebSocket-Key`: base64 of the SHA-1 of the key and
/// the GUID (§4.2.2, item 5.4).
pub fn accept(key: &str) -> String {
    let mut sha = sha1_smol::Sha1::new();
    sha.update(key.trim().as_bytes());
    sha.update(GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(sha.digest().bytes())
}

/// A `Sec-WebSocket-Key`: 16 random bytes, base64 (§4.1: a nonce, not a secret).
pub fn key(rng: &mut Rng) -> String {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
    bytes[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// One frame read from the front of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub fin: bool,
    pub opcode: u8,
    /// The masking key, where the frame is masked.
    pub mask: Option<[u8; 4]>,
    /// Where the payload starts in the buffer; it runs to `len`.
    pub payload_at: usize,
    /// The whole frame's length: header and payload.
    pub len: usize,
}

impl Frame {
    pub fn payload<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[self.payload_at..self.len]
    }

    pub fn is_control(&self) -> bool {
        self.opcode & 0x8 != 0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parse {
    Frame(Frame),
    /// More bytes are needed.
    Incomplete,
    /// Not a frame this side accepts (§5.2, §5.5): the reason.
    Invalid(&'static str),
}

/// The frame at the front of `buf`, if it is all there. A payload above `max_payload` is
/// refused rather than waited for.
pub fn parse(buf: &[u8], max_payload: usize) -> Parse {
    if buf.len() < 2 {
        return Parse::Incomplete;
    }
    let (b0, b1) = (buf[0], buf[1]);
    if b0 & 0x70 != 0 {
        return Parse::Invalid("reserved bits set without an extension");
    }
    let opcode = b0 & 0x0F;
    if !matches!(opcode, CONTINUATION | TEXT | BINARY | CLOSE | PING | PONG) {
        return Parse::Invalid("reserved opcode");
    }
    let fin = b0 & 0x80 != 0;
    let masked = b1 & 0x80 != 0;
    let (len, mut at) = match b1 & 0x7F {
        126 if buf.len() < 4 => return Parse::Incomplete,
        126 => (u64::from(u16::from_be_bytes([buf[2], buf[3]])), 4),
        127 if buf.len() < 10 => return Parse::Incomplete,
        127 => {
            let mut be = [0u8; 8];
            be.copy_from_slice(&buf[2..10]);
            (u64::from_be_bytes(be), 10)
        }
        n => (u64::from(n), 2),
    };
    if opcode & 0x8 != 0 && (len > 125 || !fin) {
        return Parse::Invalid("a control frame over 125 bytes, or fragmented");
    }
    if len > max_payload as u64 {
        return Parse::Invalid("payload too large");
    }
    let mask = if masked {
        if buf.len() < at + 4 {
            return Parse::Incomplete;
        }
        let key = [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]];
        at += 4;
        Some(key)
    } else {
        None
    };
    let total = at + len as usize;
    if buf.len() < total {
        return Parse::Incomplete;
    }
    Parse::Frame(Frame {
        fin,
        opcode,
        mask,
        payload_at: at,
        len: total,
    })
}

/// Appends a frame's header: masked with `mask` where given (a client's frame).
pub fn header(out: &mut Vec<u8>, fin: bool, opcode: u8, len: usize, mask: Option<[u8; 4]>) {
    out.push(if fin { 0x80 } else { 0 } | opcode);
    let bit = if mask.is_some() { 0x80 } else { 0 };
    if len < 126 {
        out.push(bit | len as u8);
    } else if len <= usize::from(u16::MAX) {
        out.push(bit | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(bit | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    if let Some(key) = mask {
        out.extend_from_slice(&key);
    }
}

/// Appends `payload` XORed with `key` (§5.3): masks a client's payload, and unmasks one.
pub fn xor_into(out: &mut Vec<u8>, payload: &[u8], key: Option<[u8; 4]>) {
    match key {
        None => out.extend_from_slice(payload),
        Some(key) => out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i & 3])),
    }
}

/// Appends a whole frame, masked with `mask` where given.
pub fn write(out: &mut Vec<u8>, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) {
    header(out, true, opcode, payload.len(), mask);
    xor_into(out, payload, mask);
}

/// A close frame's payload: the status code and a reason (§5.5.1).
pub fn close_payload(code: u16, reason: &str) -> Vec<u8> {
    let mut p = code.to_be_bytes().to_vec();
    p.extend_from_slice(reason.as_bytes());
    p
}

/// The status code of a close frame's payload (1005, "no status", where it has none).
pub fn close_code(payload: &[u8]) -> u16 {
    match payload {
        [a, b, ..] => u16::from_be_bytes([*a, *b]),
        _ => 1005,
    }
}

/// xorshift64*: masking keys and handshake nonces, cheap and good enough for a benchmark
/// (§10.3 asks for unpredictable masks to defeat proxy cache poisoning, not for secrecy).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn mask(&mut self) -> [u8; 4] {
        (self.next_u64() as u32).to_le_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_matches_the_rfc_example() {
        // RFC 6455 §1.3
        assert_eq!(
            accept("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn a_masked_frame_reads_back() {
        let mut out = Vec::new();
        write(&mut out, TEXT, b"Hello", Some([0x37, 0xfa, 0x21, 0x3d]));
        // RFC 6455 §5.7: a masked "Hello"
        assert_eq!(
            out,
            [0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58]
        );
        let Parse::Frame(f) = parse(&out, 1 << 20) else {
            panic!("not a frame")
        };
        let mut plain = Vec::new();
        xor_into(&mut plain, f.payload(&out), f.mask);
        assert_eq!((f.fin, f.opcode, &plain[..]), (true, TEXT, &b"Hello"[..]));
        assert_eq!(parse(&out[..out.len() - 1], 1 << 20), Parse::Incomplete);
    }

    #[test]
    fn lengths_take_their_three_forms() {
        for len in [0, 125, 126, 65_535, 65_536] {
            let mut out = Vec::new();
            write(&mut out, BINARY, &vec![7; len], None);
            let Parse::Frame(f) = parse(&out, 1 << 20) else {
                panic!("not a frame")
            };
            assert_eq!((f.len, f.payload(&out).len()), (out.len(), len));
        }
    }
}
