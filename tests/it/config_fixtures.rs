//! Bad configuration files, one per failure, each with the exact error it must produce
//! (`tests/fixtures/bad-config/<case>.toml` and `<case>.expected`: line, column, key,
//! message); then random mutations of the shipped file, which must never panic the parser.

use crate::common;

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use ratewall::config::{Config, ConfigError};

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bad-config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("fixtures folder")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_bad_config_is_rejected_with_its_exact_error() {
    let _watch = common::watchdog();
    let files = fixtures();
    assert!(files.len() >= 25, "the fixtures are there: {}", files.len());
    for file in files {
        let expected = std::fs::read_to_string(file.with_extension("expected"))
            .unwrap_or_else(|_| panic!("{} has no .expected", file.display()));
        match Config::load(&file) {
            Err(ConfigError::Invalid {
                path,
                line,
                column,
                key,
                message,
            }) => {
                assert_eq!(path, file);
                let got = format!("{line}:{column}: {key}: {message}");
                assert_eq!(got, expected.trim_end(), "{}", file.display());
            }
            Err(e) => panic!("{}: unexpected error {e}", file.display()),
            Ok(_) => panic!("{} was accepted", file.display()),
        }
    }
}

/// Where an error points must be inside the file.
fn check_position(text: &str, e: &ConfigError) {
    if let ConfigError::Invalid { line, column, .. } = e {
        let lines: Vec<&str> = text.split('\n').collect();
        assert!(
            *line >= 1 && *line <= lines.len(),
            "line {line} of {}",
            lines.len()
        );
        let width = lines[*line - 1].chars().count();
        assert!(
            *column >= 1 && *column <= width + 1,
            "column {column} of a {width}-char line"
        );
    }
}

const SHIPPED: &str = include_str!("../../config/limits.toml");

#[derive(Debug, Clone)]
enum Edit {
    Delete(usize),
    Insert(usize, char),
    Replace(usize, char),
    DuplicateLine(usize),
    DropLine(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let ch = prop_oneof![
        Just('"'),
        Just('['),
        Just(']'),
        Just('='),
        Just('\n'),
        Just('/'),
        Just('0'),
        Just('-'),
        Just('{'),
        Just('é'),
        any::<char>()
    ];
    prop_oneof![
        any::<usize>().prop_map(Edit::Delete),
        (any::<usize>(), ch.clone()).prop_map(|(i, c)| Edit::Insert(i, c)),
        (any::<usize>(), ch).prop_map(|(i, c)| Edit::Replace(i, c)),
        any::<usize>().prop_map(Edit::DuplicateLine),
        any::<usize>().prop_map(Edit::DropLine),
    ]
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for e in edits {
        match *e {
            Edit::Delete(i) if !chars.is_empty() => {
                chars.remove(i % chars.len());
            }
            Edit::Insert(i, c) => chars.insert(i % (chars.len() + 1), c),
            Edit::Replace(i, c) if !chars.is_empty() => {
                let n = chars.len();
                chars[i % n] = c;
            }
            Edit::DuplicateLine(i) | Edit::DropLine(i) => {
                let s: String = chars.iter().collect();
                let mut lines: Vec<String> = s.split('\n').map(str::to_string).collect();
                let at = i % lines.len();
                if matches!(e, Edit::DuplicateLine(_)) {
                    lines.insert(at, lines[at].clone());
                } else {
                    lines.remove(at);
                }
                chars = lines.join("\n").chars().collect();
            }
            _ => {}
        }
    }
    chars.into_iter().collect()
}

/// Any mutation of the shipped file is either a valid config or a clear error that points
/// inside the file; the parser never panics.
#[test]
fn mutated_configs_never_panic_and_errors_point_inside_the_file() {
    let _watch = common::watchdog();
    crate::proptest_seeds!("config_fixtures::mutated_configs_never_panic", 2_000, |(edits in prop::collection::vec(edit(), 1..6))| {
        let text = apply(SHIPPED, &edits);
        if let Err(e) = Config::parse(&text, Path::new("limits.toml")) {
            check_position(&text, &e);
            prop_assert!(!e.to_string().is_empty());
        }
    });
}
