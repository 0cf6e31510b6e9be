//! Each coding decoded whole however the body is cut, bombs stopped at the budget, corrupt
//! and truncated streams refused without a panic. gzip and deflate are made by flate2's
//! encoders, zstd by ruzstd's; brotli streams were made by the reference encoder
//! (`brotli -q 11`, and `-q 5` for 1 GiB of zeros) and are kept in `testdata/`, as is a
//! zstd stream of the reference encoder's (`zstd -19`, with its checksum).

use std::io::Write;

use flate2::write::{DeflateEncoder, GzEncoder, ZlibEncoder};
use flate2::{Compress, Compression, FlushCompress};
use http::HeaderValue;

use super::*;
use crate::settle::usage::{Framing, UsageField, UsageScanner};

/// An OpenAI chat completion, with its usage.
const ANSWER: &[u8] = include_bytes!("testdata/usage.json");
const ANSWER_BR: &[u8] = include_bytes!("testdata/usage.json.br");
const ANSWER_ZSTD: &[u8] = include_bytes!("testdata/usage.json.zst");
const ZEROS_BR: &[u8] = include_bytes!("testdata/zeros-1gib.br");

const GIB: u64 = 1 << 30;

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), Compression::default());
    e.write_all(data).expect("in memory");
    e.finish().expect("in memory")
}

fn zlib(data: &[u8]) -> Vec<u8> {
    let mut e = ZlibEncoder::new(Vec::new(), Compression::default());
    e.write_all(data).expect("in memory");
    e.finish().expect("in memory")
}

fn raw(data: &[u8]) -> Vec<u8> {
    let mut e = DeflateEncoder::new(Vec::new(), Compression::default());
    e.write_all(data).expect("in memory");
    e.finish().expect("in memory")
}

fn zstd(data: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(data, ruzstd::encoding::CompressionLevel::Fastest)
}

/// A gzip member with every optional header part (RFC 1952 §2.3.1: FEXTRA, FNAME,
/// FCOMMENT, FHCRC), which flate2's encoder does not all write.
fn gzip_with_every_header_part(data: &[u8]) -> Vec<u8> {
    let mut wire = vec![
        0x1f,
        0x8b,
        8,
        FEXTRA | FNAME | FCOMMENT | FHCRC,
        0,
        0,
        0,
        0,
        0,
        255,
    ];
    wire.extend_from_slice(&[3, 0, b'x', b'y', b'z']);
    wire.extend_from_slice(b"answer.json\0a comment\0");
    wire.extend_from_slice(&[0xAB, 0xCD]);
    wire.extend_from_slice(&raw(data));
    let mut crc = Crc::new();
    crc.update(data);
    wire.extend_from_slice(&crc.sum().to_le_bytes());
    wire.extend_from_slice(&crc.amount().to_le_bytes());
    wire
}

/// The answer in every coding, as encoders write it.
fn coded_answers() -> Vec<(Coding, &'static str, Vec<u8>)> {
    vec![
        (Coding::Gzip, "gzip", gzip(ANSWER)),
        (
            Coding::Gzip,
            "gzip, every header part",
            gzip_with_every_header_part(ANSWER),
        ),
        (Coding::Deflate, "zlib", zlib(ANSWER)),
        (Coding::Deflate, "raw deflate", raw(ANSWER)),
        (Coding::Brotli, "brotli", ANSWER_BR.to_vec()),
        (
            Coding::Zstd,
            "zstd, reference encoder",
            ANSWER_ZSTD.to_vec(),
        ),
        (Coding::Zstd, "zstd, ruzstd", zstd(ANSWER)),
    ]
}

/// `wire` decoded, fed in `pieces`, then finished.
fn decode<'a>(
    coding: Coding,
    pieces: impl IntoIterator<Item = &'a [u8]>,
    budget: u64,
) -> (Vec<u8>, Result<(), DecodeError>) {
    let mut d = Decoder::new(coding, budget);
    let mut out = Vec::new();
    for piece in pieces {
        if let Err(e) = d.feed(piece, |b| out.extend_from_slice(b)) {
            return (out, Err(e));
        }
    }
    let end = d.finish();
    assert_eq!(d.decoded(), out.len() as u64);
    (out, end)
}

#[test]
fn each_coding_decodes_whole_however_the_body_is_cut() {
    for (coding, name, wire) in coded_answers() {
        for at in 0..=wire.len() {
            let (out, end) = decode(coding, [&wire[..at], &wire[at..]], GIB);
            assert_eq!(end, Ok(()), "{name}, cut at {at}");
            assert!(out == ANSWER, "{name}, cut at {at}");
        }
        let (out, end) = decode(coding, wire.chunks(1), GIB);
        assert_eq!(
            (out.as_slice(), end),
            (ANSWER, Ok(())),
            "{name}, a byte at a time"
        );
    }
}

#[test]
fn the_scanner_reads_the_usage_of_a_compressed_answer() {
    for (coding, name, wire) in coded_answers() {
        let mut scanner = UsageScanner::new(Framing::Json, UsageField::TotalTokens);
        let mut d = Decoder::new(coding, 4 * wire.len() as u64 + 64 * 1024);
        for piece in wire.chunks(7) {
            assert_eq!(d.feed(piece, |b| scanner.feed(b)), Ok(()), "{name}");
        }
        assert_eq!(d.finish(), Ok(()), "{name}");
        assert_eq!(scanner.finish(), Some(29), "{name}");
    }
}

#[test]
fn a_large_answer_decodes_through_the_small_scratch_buffer() {
    // Text that compresses a little, longer than the scratch buffer many times over.
    let text: Vec<u8> = (0..300_000u32)
        .flat_map(|i| format!("{i} ").into_bytes())
        .collect();
    for (coding, wire) in [
        (Coding::Gzip, gzip(&text)),
        (Coding::Deflate, zlib(&text)),
        (Coding::Deflate, raw(&text)),
        (Coding::Zstd, zstd(&text)),
    ] {
        let mut pieces = 0;
        let mut d = Decoder::new(coding, GIB);
        let mut out = Vec::new();
        for chunk in wire.chunks(16 * 1024) {
            let fed = d.feed(chunk, |b| {
                assert!(b.len() <= SCRATCH);
                pieces += 1;
                out.extend_from_slice(b);
            });
            assert_eq!(fed, Ok(()), "{coding}");
        }
        assert_eq!(d.finish(), Ok(()), "{coding}");
        assert!(out == text, "{coding}");
        assert!(pieces >= text.len() / SCRATCH, "{coding}");
    }
}

#[test]
fn members_and_frames_follow_one_another() {
    let (a, b) = (&b"first "[..], &b"second"[..]);
    let gz = [gzip(a), gzip(b)].concat();
    assert_eq!(
        decode(Coding::Gzip, [&gz[..]], GIB),
        (b"first second".to_vec(), Ok(()))
    );
    // A skippable frame (RFC 8878 §3.1.2), then two frames.
    let skippable = [
        &0x184D_2A53u32.to_le_bytes()[..],
        &3u32.to_le_bytes(),
        b"abc",
    ]
    .concat();
    let zst = [skippable, zstd(a), zstd(b)].concat();
    for step in [1, 5, zst.len()] {
        let (out, end) = decode(Coding::Zstd, zst.chunks(step), GIB);
        assert_eq!(
            (out.as_slice(), end),
            (&b"first second"[..], Ok(())),
            "step {step}"
        );
    }
}

#[test]
fn the_budget_is_handed_over_exactly() {
    let wire = gzip(ANSWER);
    let whole = ANSWER.len() as u64;
    assert_eq!(
        decode(Coding::Gzip, [&wire[..]], whole),
        (ANSWER.to_vec(), Ok(()))
    );
    let (out, end) = decode(Coding::Gzip, [&wire[..]], whole - 1);
    assert_eq!(end, Err(DecodeError::Exhausted { budget: whole - 1 }));
    assert_eq!(out, &ANSWER[..ANSWER.len() - 1]);
}

/// Raw deflate of 1 GiB of zeros, made without compressing a GiB: 1 MiB of zeros
/// compressed once with a full flush (which forgets the history, so the bytes stand
/// alone), repeated 1,024 times, then an empty final block (fixed codes: `03 00`).
fn deflated_zeros() -> Vec<u8> {
    let mut c = Compress::new(Compression::best(), false);
    let mut segment = Vec::with_capacity(4096);
    let zeros = vec![0u8; 1 << 20];
    c.compress_vec(&zeros, &mut segment, FlushCompress::Full)
        .expect("in memory");
    assert_eq!(c.total_in(), 1 << 20, "one call compresses it all");
    let mut wire = segment.repeat(1024);
    wire.extend_from_slice(&[0x03, 0x00]);
    wire
}

/// 1 GiB of zeros in zstd: RLE blocks of 128 KiB (RFC 8878 §3.1.1.2), four bytes each.
fn zstd_zeros() -> Vec<u8> {
    // No checksum, no content size, a 128 KiB window (exponent 7).
    let mut wire = [&MAGIC_ZSTD[..], &[0x00, 7 << 3]].concat();
    let blocks = GIB / (128 << 10);
    for i in 0..blocks {
        let last = u32::from(i + 1 == blocks);
        let header = last | 1 << 1 | (128 << 10) << 3;
        wire.extend_from_slice(&header.to_le_bytes()[..3]);
        wire.push(0);
    }
    wire
}

const MAGIC_ZSTD: [u8; 4] = 0xFD2F_B528u32.to_le_bytes();

#[test]
fn a_bomb_stops_at_the_budget_after_little_input() {
    let deflated = deflated_zeros();
    // Their trailers are never reached: the gzip one is left zero.
    let gzip = [
        &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255][..],
        &deflated,
        &[0; 8],
    ]
    .concat();
    let adler = (u32::try_from(GIB % 65521).expect("small") << 16) | 1;
    let zlib = [&[0x78, 0xda][..], &deflated, &adler.to_be_bytes()].concat();
    let budget = 1 << 20;
    for (coding, name, wire) in [
        (Coding::Gzip, "gzip", gzip),
        (Coding::Deflate, "zlib", zlib),
        (Coding::Deflate, "raw deflate", deflated),
        (Coding::Brotli, "brotli", ZEROS_BR.to_vec()),
        (Coding::Zstd, "zstd", zstd_zeros()),
    ] {
        let mut d = Decoder::new(coding, budget);
        let (mut fed, mut out) = (0, 0u64);
        let mut stopped = None;
        for chunk in wire.chunks(4096) {
            fed += chunk.len();
            if let Err(e) = d.feed(chunk, |b| out += b.len() as u64) {
                stopped = Some(e);
                break;
            }
        }
        assert_eq!(stopped, Some(DecodeError::Exhausted { budget }), "{name}");
        assert_eq!((out, d.decoded()), (budget, budget), "{name}");
        // A few KiB of input for 1 MiB out (deflate's ratio is about 1,000 to 1).
        assert!(fed <= 8192, "{name}: {fed} bytes fed");
        // And no more once it stopped.
        let again = d.feed(&wire[..16], |_| out += 1);
        assert_eq!(again, Err(DecodeError::Exhausted { budget }), "{name}");
        assert_eq!(out, budget, "{name}");
        assert_eq!(d.finish(), Err(DecodeError::Exhausted { budget }), "{name}");
    }
}

#[test]
fn corrupt_streams_are_errors() {
    let corrupt = |c| (Vec::new(), Err(DecodeError::Corrupt(c)));
    let mut bad_magic = gzip(ANSWER);
    bad_magic[1] = 0x8c;
    assert_eq!(
        decode(Coding::Gzip, [&bad_magic[..]], GIB),
        corrupt(Coding::Gzip)
    );
    let mut reserved = gzip(ANSWER);
    reserved[3] |= 0x80;
    assert_eq!(
        decode(Coding::Gzip, [&reserved[..]], GIB),
        corrupt(Coding::Gzip)
    );
    for coding in [Coding::Gzip, Coding::Deflate, Coding::Brotli, Coding::Zstd] {
        let (_, end) = decode(coding, [&[0xff; 64][..]], GIB);
        assert_eq!(end, Err(DecodeError::Corrupt(coding)), "{coding}");
        // An answer that is not coded at all: refused from its first bytes, but by raw
        // deflate, which has no header and reads `{` as the start of a block (it fails
        // further on, or ends short).
        let (_, end) = decode(coding, [ANSWER], GIB);
        match coding {
            Coding::Deflate => assert!(end.is_err()),
            _ => assert_eq!(end, Err(DecodeError::Corrupt(coding)), "{coding}"),
        }
    }
    // A checksum that does not match: the data came, the error after it.
    let mut crc = gzip(ANSWER);
    let at = crc.len() - 8;
    crc[at] ^= 1;
    assert_eq!(
        decode(Coding::Gzip, [&crc[..]], GIB),
        (ANSWER.to_vec(), Err(DecodeError::Corrupt(Coding::Gzip)))
    );
    let mut adler = zlib(ANSWER);
    let last = adler.len() - 1;
    adler[last] ^= 1;
    assert_eq!(
        decode(Coding::Deflate, [&adler[..]], GIB).1,
        Err(DecodeError::Corrupt(Coding::Deflate))
    );
    // Bytes after the end.
    for (coding, name, wire) in coded_answers() {
        if coding == Coding::Gzip {
            // A gzip stream goes on with another member: these are its broken header.
            continue;
        }
        let (_, end) = decode(coding, [&wire[..], b"\x01junk"], GIB);
        assert_eq!(end, Err(DecodeError::Corrupt(coding)), "{name}");
    }
    let (_, end) = decode(Coding::Gzip, [&gzip(ANSWER)[..], b"junk!junk!"], GIB);
    assert_eq!(end, Err(DecodeError::Corrupt(Coding::Gzip)));
}

#[test]
fn a_stream_cut_short_is_truncated() {
    for (coding, name, wire) in coded_answers() {
        for cut in [0, 1, wire.len() / 2, wire.len() - 1] {
            let (_, end) = decode(coding, [&wire[..cut]], GIB);
            assert_eq!(
                end,
                Err(DecodeError::Truncated(coding)),
                "{name} cut at {cut}"
            );
        }
    }
}

#[test]
fn no_damage_to_a_stream_makes_the_decoder_panic() {
    for (coding, name, wire) in coded_answers() {
        for at in 0..wire.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut bad = wire.clone();
                bad[at] ^= flip;
                // Any answer but a panic; whatever came out is bounded by the budget.
                let (out, _) = decode(coding, bad.chunks(3), 1 << 20);
                assert!(out.len() <= 1 << 20, "{name}: flip {flip:#x} at {at}");
            }
            let (_, end) = decode(coding, [&wire[..at]], GIB);
            assert!(end.is_err(), "{name} cut at {at}");
        }
    }
}

#[test]
fn zstd_frames_that_ask_too_much_are_refused() {
    // A 16 MiB window (exponent 14), over RFC 9659's 8 MiB.
    let wide = [&MAGIC_ZSTD[..], &[0x00, 14 << 3], &[0x01, 0x00, 0x00]].concat();
    let too_demanding = Err(DecodeError::TooDemanding(Coding::Zstd));
    assert_eq!(decode(Coding::Zstd, [&wide[..]], GIB).1, too_demanding);
    // A one-byte dictionary ID (flag 1) of 7.
    let dictionary = [&MAGIC_ZSTD[..], &[0x01, 7 << 3, 7], &[0x01, 0x00, 0x00]].concat();
    assert_eq!(
        decode(Coding::Zstd, [&dictionary[..]], GIB).1,
        too_demanding
    );
    // 8 MiB is allowed (exponent 13): an empty raw last block.
    let widest = [&MAGIC_ZSTD[..], &[0x00, 13 << 3], &[0x01, 0x00, 0x00]].concat();
    assert_eq!(
        decode(Coding::Zstd, [&widest[..]], GIB),
        (Vec::new(), Ok(()))
    );
}

#[test]
fn a_decoder_goes_with_its_answer_across_threads() {
    fn send<T: Send>() {}
    send::<Decoder>();
}

#[test]
fn an_error_stays() {
    let mut d = Decoder::new(Coding::Gzip, GIB);
    let bad = Err(DecodeError::Corrupt(Coding::Gzip));
    assert_eq!(d.feed(b"nope", |_| {}), bad);
    let wire = gzip(ANSWER);
    let mut out = 0;
    assert_eq!(d.feed(&wire, |b| out += b.len()), bad);
    assert_eq!((d.finish(), out), (bad, 0));
}

/// The coding named by `values`, one `Content-Encoding` field each.
fn coding_of(values: &[&str]) -> Result<Option<Coding>, Unsupported> {
    let mut headers = HeaderMap::new();
    for v in values {
        headers.append(CONTENT_ENCODING, HeaderValue::from_str(v).expect("a value"));
    }
    Coding::of(&headers)
}

#[test]
fn content_encoding_names_one_coding_or_none() {
    assert_eq!(coding_of(&[]), Ok(None));
    for none in ["identity", "", " , ", "Identity"] {
        assert_eq!(coding_of(&[none]), Ok(None), "{none:?}");
    }
    for (value, coding) in [
        ("gzip", Coding::Gzip),
        ("GZip", Coding::Gzip),
        ("x-gzip", Coding::Gzip),
        (" gzip ,", Coding::Gzip),
        ("identity, gzip", Coding::Gzip),
        ("deflate", Coding::Deflate),
        ("br", Coding::Brotli),
        ("zstd", Coding::Zstd),
    ] {
        assert_eq!(coding_of(&[value]), Ok(Some(coding)), "{value:?}");
        assert_eq!(Coding::of(&HeaderMap::new()), Ok(None));
    }
    for (values, why) in [
        (&["gzip, gzip"][..], Unsupported::Stacked),
        (&["gzip", "br"], Unsupported::Stacked),
        (&["deflate, zstd"], Unsupported::Stacked),
        (&["compress"], Unsupported::Unknown),
        (&["x-compress"], Unsupported::Unknown),
        (&["gzip;q=1"], Unsupported::Unknown),
        (&["aes128gcm"], Unsupported::Unknown),
    ] {
        assert_eq!(coding_of(values), Err(why), "{values:?}");
    }
    let mut headers = HeaderMap::new();
    let opaque = HeaderValue::from_bytes(b"gzip\xff").expect("a value");
    headers.insert(CONTENT_ENCODING, opaque);
    assert_eq!(Coding::of(&headers), Err(Unsupported::Unknown));
    let decoder = Decoder::of(&headers, GIB).err();
    assert_eq!(decoder, Some(Unsupported::Unknown));
    let mut gz = HeaderMap::new();
    gz.insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    let decoder = Decoder::of(&gz, GIB).ok().flatten().map(|d| d.coding());
    assert_eq!(decoder, Some(Coding::Gzip));
}
