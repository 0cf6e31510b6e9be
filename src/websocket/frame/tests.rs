//! The scanner against frames written by hand: every length encoding, every MUST of §5 it
//! refuses, what it drops after a close, where a size limit and a budget stop it; and,
//! by property, any valid stream cut into reads any way.

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

/// Data frames, as many as `n`; payload bytes without limit.
fn frames(n: u64) -> Budget {
    Budget {
        frames: n,
        bytes: u64::MAX,
    }
}

/// Everything scanned in one call with tokens to spare.
fn scan_all(side: Side, stream: &[u8]) -> Result<Scan, Violation> {
    Scanner::new(side).scan(stream, Budget::UNLIMITED)
}

fn refused(side: Side, frames: &[F]) -> &'static str {
    match scan_all(side, &bytes(frames, side)) {
        Err(Violation(why)) => why,
        Ok(s) => panic!("{frames:?} passed: {s:?}"),
    }
}

/// What a copy loop makes of `stream` through `s`, fed whole: the bytes passed, the
/// bytes dropped, the data frames and payload bytes counted, and the last stop.
fn pass_through(s: &mut Scanner, stream: &[u8]) -> (Vec<u8>, usize, u64, u64, Option<Stop>) {
    let (mut passed, mut dropped, mut counted, mut payload) = (Vec::new(), 0, 0, 0);
    let mut at = 0;
    loop {
        let scan = s.scan(&stream[at..], Budget::UNLIMITED).unwrap();
        passed.extend_from_slice(&stream[at..at + scan.passed]);
        at += scan.passed;
        counted += scan.frames;
        payload += scan.bytes;
        match scan.stop {
            Some(Stop::Discard(n)) => {
                at += n;
                dropped += n;
            }
            stop => return (passed, dropped, counted, payload, stop),
        }
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
                let one = s.scan(&stream[..first], Budget::UNLIMITED).unwrap();
                assert_eq!(
                    (one.passed, one.frames, one.bytes),
                    (first, 1, len as u64),
                    "{len} {width:?}"
                );
                assert!(s.at_boundary(), "{len} {width:?}");
                let two = s.scan(&stream[first..], frames(0)).unwrap();
                assert_eq!(
                    (two.passed, two.frames, two.stop),
                    (0, 0, Some(Stop::Tokens { bytes: 3 }))
                );
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
    let scan = s.scan(&stream, frames(1)).unwrap();
    assert_eq!((scan.passed, scan.bytes), (stream.len(), u64::MAX >> 1));
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
    // Known from a data frame's second byte, before its header is all there.
    assert_eq!(
        scan_all(Side::Client, &unmasked[..2]),
        Err(Violation("unmasked frame from the client"))
    );
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
    assert_eq!(scan.bytes, 18, "nor their payloads");
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
}

#[test]
fn data_frames_after_a_close_are_dropped_and_control_frames_still_pass() {
    for side in [Side::Client, Side::Server] {
        let kept = [f(true, TEXT, 5), f(true, CLOSE, 2)];
        let after = [
            f(true, TEXT, 3),
            // Each of these would break §5.4 before a close: here they are dropped.
            f(true, CONTINUATION, 300),
            f(false, BINARY, 70_000),
            f(true, TEXT, 0),
        ];
        let mut stream = bytes(&kept, side);
        stream.extend(bytes(&after, side));
        let ping = bytes(&[f(true, 0x9, 4)], side);
        stream.extend(&ping);
        let mut s = Scanner::new(side);
        let (passed, dropped, counted, payload, stop) = pass_through(&mut s, &stream);
        let mut want = bytes(&kept, side);
        want.extend(&ping);
        assert_eq!(passed, want, "{side:?}");
        assert_eq!(dropped, bytes(&after, side).len(), "{side:?}");
        assert_eq!((counted, payload, stop), (1, 5, None), "{side:?}");
        assert!(s.closed() && s.at_boundary());

        // Cut anywhere, the same.
        for cut in [1, 9, 20, 400, 1_000, 60_000] {
            let mut s = Scanner::new(side);
            let (mut got, mut gone, mut at) = (Vec::new(), 0, 0);
            for piece in [&stream[..cut], &stream[..]] {
                loop {
                    let scan = s.scan(&piece[at..], frames(9)).unwrap();
                    got.extend_from_slice(&piece[at..at + scan.passed]);
                    at += scan.passed;
                    match scan.stop {
                        Some(Stop::Discard(n)) => {
                            at += n;
                            gone += n;
                        }
                        None | Some(Stop::Header) => break,
                        other => panic!("{other:?}"),
                    }
                }
            }
            assert_eq!((got, gone), (want.clone(), dropped), "cut at {cut}");
        }
    }
}

#[test]
fn a_data_frame_passes_with_its_whole_header() {
    // 126 bytes: 2 + 2 of length + 4 of mask.
    let stream = bytes(&[f(true, TEXT, 300)], Side::Client);
    let mut s = Scanner::new(Side::Client);
    for part in 0..8 {
        let scan = s.scan(&stream[..part], frames(1)).unwrap();
        assert_eq!(
            (scan.passed, scan.frames, scan.stop),
            (0, 0, (part > 0).then_some(Stop::Header)),
            "{part} bytes of the header"
        );
        assert!(s.at_boundary());
    }
    let scan = s.scan(&stream[..8], frames(1)).unwrap();
    assert_eq!((scan.passed, scan.frames, scan.bytes), (8, 1, 300));
    assert!(!s.at_boundary());
    // The rest of the frame (its payload) needs no token.
    let rest = s.scan(&stream[8..], frames(0)).unwrap();
    assert_eq!((rest.passed, rest.frames, rest.stop), (300, 0, None));
    assert!(s.at_boundary());
    // A control frame's header passes as it comes.
    let ping = bytes(&[f(true, 0x9, 3)], Side::Client);
    assert_eq!(s.scan(&ping[..1], frames(0)).unwrap().passed, 1);
    assert!(!s.at_boundary());
    assert_eq!(
        s.scan(&ping[1..], frames(0)).unwrap().passed,
        ping.len() - 1
    );
}

#[test]
fn a_message_over_the_limit_stops_before_the_frame_that_makes_it_so() {
    let side = Side::Client;
    let limited = || Scanner::new(side).with_max_message(1_000);
    // One frame: 1,000 bytes pass, 1,001 do not (not one byte of it).
    let at_limit = bytes(&[f(true, BINARY, 1_000)], side);
    assert_eq!(limited().scan(&at_limit, frames(9)).unwrap().stop, None);
    let over = bytes(&[f(true, TEXT, 5), f(true, BINARY, 1_001)], side);
    let first = bytes(&[f(true, TEXT, 5)], side).len();
    let mut s = limited();
    let scan = s.scan(&over, frames(9)).unwrap();
    assert_eq!(
        (scan.passed, scan.frames, scan.stop),
        (first, 1, Some(Stop::TooBig { size: 1_001 }))
    );
    assert!(s.at_boundary(), "a close frame may follow what passed");
    // Before tokens are asked for: a frame too big is not waited for.
    let mut s = limited();
    assert_eq!(
        s.scan(&over[first..], frames(0)).unwrap().stop,
        Some(Stop::TooBig { size: 1_001 })
    );

    // Fragments add up; control frames between them do not count; the next message
    // starts from nothing.
    let fragments = [
        f(false, TEXT, 400),
        f(true, 0x9, 100),
        f(false, CONTINUATION, 600),
        f(true, CONTINUATION, 0),
        f(true, BINARY, 1_000),
        f(false, BINARY, 999),
        f(true, CONTINUATION, 2),
    ];
    let stream = bytes(&fragments, side);
    let held = bytes(&fragments[..6], side).len();
    let mut s = limited();
    let scan = s.scan(&stream, frames(99)).unwrap();
    assert_eq!(
        (scan.passed, scan.frames, scan.bytes),
        (held, 5, 400 + 600 + 1_000 + 999)
    );
    assert_eq!(scan.stop, Some(Stop::TooBig { size: 1_001 }));
    // No limit: anything (up to 2^63 - 1) passes.
    assert_eq!(scan_all(side, &stream).unwrap().passed, stream.len());
}

#[test]
fn a_byte_budget_stops_before_a_payload_it_cannot_pay_for_whole() {
    let stream = bytes(
        &[
            f(true, TEXT, 100),
            f(true, 0x9, 50),
            f(true, BINARY, 200),
            f(true, TEXT, 0),
        ],
        Side::Client,
    );
    let two = bytes(&[f(true, TEXT, 100), f(true, 0x9, 50)], Side::Client).len();
    let budget = Budget {
        frames: 9,
        bytes: 299,
    };
    let mut s = Scanner::new(Side::Client);
    let scan = s.scan(&stream, budget).unwrap();
    assert_eq!(
        (scan.passed, scan.frames, scan.bytes, scan.stop),
        (two, 1, 100, Some(Stop::Tokens { bytes: 200 })),
        "the ping passes, the binary frame needs 200 of the 199 left"
    );
    let rest = s
        .scan(
            &stream[two..],
            Budget {
                frames: 2,
                bytes: 200,
            },
        )
        .unwrap();
    assert_eq!(
        (rest.passed, rest.frames, rest.bytes, rest.stop),
        (stream.len() - two, 2, 200, None),
        "an empty frame needs a frame token, no byte"
    );
    assert_eq!(
        budget.after(&scan),
        Budget {
            frames: 8,
            bytes: 199
        }
    );
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
    let frames_ = [
        f(true, 0x9, 3),
        f(true, TEXT, 2),
        f(true, 0xA, 0),
        f(true, BINARY, 4),
    ];
    let stream = bytes(&frames_, Side::Client);
    let ping = bytes(&frames_[..1], Side::Client).len();
    let then_pong = bytes(&frames_[..3], Side::Client).len();
    let mut s = Scanner::new(Side::Client);
    let a = s.scan(&stream, frames(0)).unwrap();
    assert_eq!(
        (a.passed, a.frames, a.stop),
        (ping, 0, Some(Stop::Tokens { bytes: 2 }))
    );
    assert!(s.at_boundary());
    let b = s.scan(&stream[a.passed..], frames(1)).unwrap();
    assert_eq!(
        (b.passed, b.frames, b.stop),
        (then_pong - ping, 1, Some(Stop::Tokens { bytes: 4 }))
    );
    let c = s.scan(&stream[then_pong..], frames(5)).unwrap();
    assert_eq!(
        (c.passed, c.frames, c.stop),
        (stream.len() - then_pong, 1, None)
    );
    assert!(s.at_boundary());
    // Nothing to scan: nothing stopped.
    assert_eq!(
        s.scan(&[], frames(0)).unwrap(),
        Scan {
            passed: 0,
            frames: 0,
            bytes: 0,
            stop: None
        }
    );
}

#[test]
fn a_violation_passes_nothing_of_its_call_and_sticks() {
    let ping = bytes(&[f(true, 0x9, 3)], Side::Client);
    let mut stream = ping.clone();
    stream.extend(bytes(&[f(true, CONTINUATION, 3)], Side::Client));
    let mut s = Scanner::new(Side::Client);
    assert_eq!(s.scan(&ping[..4], frames(9)).unwrap().passed, 4);
    let why = s.scan(&stream[4..], frames(9)).unwrap_err();
    assert_eq!(why.0, "continuation frame outside a fragmented message");
    // Still where it was: inside the ping's header.
    assert!(!s.at_boundary());
    assert_eq!(s.scan(&[], frames(9)), Err(why));
    assert_eq!(why.to_string(), why.0);
}

#[test]
fn a_1_mib_fragmented_message_scans_in_constant_memory() {
    // All the scanner ever holds: no payload, no buffer that grows.
    assert!(std::mem::size_of::<Scanner>() <= 64);
    let mut s = Scanner::new(Side::Client).with_max_message(1 << 20);
    let zeros = [0u8; 4096];
    let fragment = 64 * 1024;
    let mut counted = 0;
    for i in 0..16 {
        let opcode = if i == 0 { TEXT } else { CONTINUATION };
        let mut header = Vec::new();
        write(f(i == 15, opcode, 0), Side::Client, &mut header);
        // The same header with the 64-bit length of a 64 KiB fragment.
        header[1] = MASK | 127;
        header.splice(2..2, (fragment as u64).to_be_bytes());
        let scan = s.scan(&header, frames(1)).unwrap();
        assert_eq!(scan.passed, header.len());
        counted += scan.frames;
        for _ in 0..fragment / zeros.len() {
            let scan = s.scan(&zeros, frames(0)).unwrap();
            assert_eq!((scan.passed, scan.stop), (zeros.len(), None));
        }
        assert!(s.at_boundary());
        if i == 7 {
            // A ping between fragments.
            let ping = bytes(&[f(true, 0x9, 125)], Side::Client);
            assert_eq!(s.scan(&ping, frames(0)).unwrap().passed, ping.len());
        }
    }
    assert_eq!(counted, 16);
    // The message is finished, at exactly its limit: a new one may begin.
    let next = bytes(&[f(true, BINARY, 1)], Side::Client);
    assert_eq!(s.scan(&next, frames(1)).unwrap().frames, 1);
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
    assert_eq!(s.scan(&masked, frames(0)).unwrap().passed, masked.len());
    assert!(s.closed() && s.at_boundary());
    assert_eq!(
        close_frame(INTERNAL_ERROR, "", None),
        [FIN | CLOSE, 2, 0x03, 0xF3]
    );
    assert_eq!(
        close_frame(MESSAGE_TOO_BIG, "", None),
        [FIN | CLOSE, 2, 0x03, 0xF1]
    );
}

/// A valid stream: messages of 1 to 4 fragments, control frames between them and
/// between fragments, lengths in every width; perhaps a close at the end, and after
/// it data frames a sender must not send (dropped) and control frames (passed).
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
    let control = (
        prop_oneof![Just(0x9u8), Just(0xA)],
        0usize..=125,
        width.clone(),
    );
    let piece = (data, proptest::option::weighted(0.3, control.clone()));
    let message = (
        prop_oneof![Just(TEXT), Just(BINARY)],
        proptest::collection::vec(piece, 1..=4),
    );
    let stray = (
        prop_oneof![Just(CONTINUATION), Just(TEXT), Just(BINARY)],
        any::<bool>(),
        len,
        width,
    );
    let after = proptest::collection::vec((stray, proptest::option::weighted(0.3, control)), 0..4);
    (
        proptest::collection::vec(message, 0..6),
        proptest::option::weighted(0.3, after),
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
            if let Some(after) = close {
                frames.push(f(true, CLOSE, 2));
                for ((opcode, fin, len, width), control) in after {
                    frames.push(F {
                        width,
                        ..f(fin, opcode, len)
                    });
                    if let Some((op, len, width)) = control {
                        frames.push(F {
                            width,
                            ..f(true, op, len)
                        });
                    }
                }
            }
            frames
        })
}

/// Each frame of a stream: where it starts, its length in bytes, its payload length,
/// and what becomes of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Data,
    Control,
    Dropped,
}

fn layout(frames: &[F], side: Side) -> (Vec<(usize, usize, u64, Fate)>, usize) {
    let mut out = Vec::new();
    let (mut at, mut closed) = (0, false);
    for &fr in frames {
        let mut one = Vec::new();
        write(fr, side, &mut one);
        let fate = match (is_data(fr.opcode), closed) {
            (true, false) => Fate::Data,
            (true, true) => Fate::Dropped,
            (false, _) => Fate::Control,
        };
        closed |= fr.opcode == CLOSE;
        out.push((at, one.len(), fr.len as u64, fate));
        at += one.len();
    }
    (out, at)
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::Client), Just(Side::Server)]
}

crate::proptest_seeds! {
    #![cases(300)]

    /// However a stream is cut into reads (each read scanned as far as it goes, what
    /// is held kept for the next, as the copy loop does), the bytes that pass are
    /// those of every frame but the data frames after a close, those are dropped
    /// whole, every data frame that passes is counted once with its payload, and the
    /// scanner is at a boundary exactly between frames.
    #[test]
    fn any_split_passes_the_same_bytes_and_counts(
        frames in valid_frames(),
        side in side(),
        cuts in proptest::collection::vec(0.0f64..1.0, 0..12),
    ) {
        let stream = bytes(&frames, side);
        let (layout, end) = layout(&frames, side);
        let mut cuts: Vec<usize> = cuts.iter().map(|c| (c * end as f64) as usize).collect();
        cuts.push(end);
        cuts.sort_unstable();
        let in_dropped = |from: usize, to: usize| {
            layout.iter().any(|&(st, len, _, fate)| {
                fate == Fate::Dropped && st <= from && to <= st + len
            })
        };
        let mut s = Scanner::new(side);
        let (mut at, mut counted, mut payload) = (0, 0, 0);
        let mut passed = Vec::new();
        for cut in cuts {
            loop {
                let scan = s
                    .scan(&stream[at..cut], Budget::UNLIMITED)
                    .map_err(|v| TestCaseError::fail(v.0))?;
                passed.extend_from_slice(&stream[at..at + scan.passed]);
                counted += scan.frames;
                payload += scan.bytes;
                at += scan.passed;
                match scan.stop {
                    None => {
                        prop_assert_eq!(at, cut);
                        break;
                    }
                    Some(Stop::Discard(n)) => {
                        prop_assert!(in_dropped(at, at + n), "dropped {}..{}", at, at + n);
                        at += n;
                    }
                    Some(Stop::Header) => {
                        prop_assert!(cut - at < MAX_HEADER);
                        prop_assert!(
                            layout.iter().any(|&(st, _, _, f)| st == at && f != Fate::Control),
                            "held at {}", at
                        );
                        break;
                    }
                    Some(other) => return Err(TestCaseError::fail(format!("{other:?}"))),
                }
            }
            let between = at == end || layout.iter().any(|&(st, ..)| st == at);
            prop_assert_eq!(s.at_boundary(), between, "at {}", at);
        }
        prop_assert_eq!(at, end);
        let kept: Vec<u8> = layout
            .iter()
            .filter(|l| l.3 != Fate::Dropped)
            .flat_map(|&(st, len, ..)| stream[st..st + len].iter().copied())
            .collect();
        prop_assert!(passed == kept, "{} bytes passed, {} kept", passed.len(), kept.len());
        let data = layout.iter().filter(|l| l.3 == Fate::Data);
        prop_assert_eq!(counted, data.clone().count() as u64);
        prop_assert_eq!(payload, data.map(|l| l.2).sum::<u64>());
    }

    /// With few tokens a call (frames and payload bytes), the scan stops exactly at
    /// data frames' headers, and counts exactly the data frames (and payload) it let
    /// start: never more than the budget.
    #[test]
    fn tokens_stop_exactly_at_data_frames(
        frames in valid_frames(),
        side in side(),
        reads in proptest::collection::vec((1usize..5_000, 0u64..3, 0u64..100_000), 1..40),
    ) {
        let stream = bytes(&frames, side);
        let (layout, end) = layout(&frames, side);
        let mut s = Scanner::new(side);
        let (mut at, mut counted, mut turn, mut wanting) = (0, 0, 0, false);
        while at < end {
            let (len, tokens, bytes) = reads[turn % reads.len()];
            // Every few turns, tokens to spare: the stream always moves on; after a
            // header cut short, the read brings the rest of it.
            let budget = if turn % reads.len() == reads.len() - 1 {
                Budget { frames: tokens + 1, bytes: u64::MAX }
            } else {
                Budget { frames: tokens, bytes }
            };
            let len = if wanting { len.max(MAX_HEADER) } else { len };
            turn += 1;
            prop_assert!(turn < 10_000_000, "no progress at {}", at);
            let upto = (at + len).min(end);
            let scan = s.scan(&stream[at..upto], budget).map_err(|v| TestCaseError::fail(v.0))?;
            let started: Vec<_> = layout
                .iter()
                .filter(|&&(st, _, _, f)| f == Fate::Data && st >= at && st < at + scan.passed)
                .collect();
            prop_assert_eq!(scan.frames, started.len() as u64);
            prop_assert_eq!(scan.bytes, started.iter().map(|l| l.2).sum::<u64>());
            prop_assert!(scan.frames <= budget.frames && scan.bytes <= budget.bytes);
            let stop = at + scan.passed;
            // A header cut short is wanted whole by the next read that can start it: the
            // reads between without the tokens to start it leave it wanted.
            wanting = scan.stop == Some(Stop::Header) || (wanting && scan.passed == 0);
            match scan.stop {
                Some(Stop::Tokens { bytes }) => {
                    let next = layout.iter().find(|l| l.0 == stop);
                    prop_assert!(next.is_some_and(|l| l.3 == Fate::Data && l.2 == bytes), "stopped at {} mid-frame", stop);
                    let left = budget.after(&scan);
                    prop_assert!(left.frames == 0 || left.bytes < bytes);
                }
                Some(Stop::Discard(n)) => at += n,
                Some(Stop::Header) => prop_assert!(upto - stop < MAX_HEADER),
                None => prop_assert_eq!(stop, upto),
                Some(other) => return Err(TestCaseError::fail(format!("{other:?}"))),
            }
            counted += scan.frames;
            at += scan.passed;
        }
        prop_assert_eq!(counted, layout.iter().filter(|l| l.3 == Fate::Data).count() as u64);
        prop_assert!(s.at_boundary());
    }
}
