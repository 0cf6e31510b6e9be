//! The tag an identity is shown by (the status page, `/status.json`, the access line, the
//! admin API, `ratewall check`): 8 hex digits of a hash *keyed by a deployment secret*.
//!
//! The digest that names an identity's Redis keys is unkeyed (it must be the same on every
//! gateway, and it is the operator's), so its first digits would give an address back to
//! anyone who hashes the 2³² IPv4 addresses: a client address came back from its tag in a
//! few thousand hashes. The tag is SHA-256 over a key derived from the secret and then the
//! digest: without the secret it says nothing, and every gateway that shares the secret
//! shows the same tag.
//!
//! Where the secret comes from ([`Secret`]): `RATEWALL_TAG_SECRET` or `[server]
//! tag_secret`; else a shared store's (created once, read by every gateway); else a file
//! beside the keys file (or the config), generated at the first start.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

use super::{IdentityDigest, ShortHex};

/// The file a gateway on an in-process store keeps its generated secret in, in the keys
/// file's folder (or the config's).
pub const SECRET_FILE: &str = ".ratewall-tag-secret";

/// What a tag reads while the secret is not known yet (a shared store not reached).
const UNKNOWN: ShortHex = ShortHex(*b"--------");

/// The process's tags: one secret per process, set once at start ([`IdentityDigest::tag`]).
static PROCESS: Tags = Tags(OnceLock::new());

/// The tags this process shows.
pub fn process() -> &'static Tags {
    &PROCESS
}

/// The key tags are made with, from a secret of any length.
#[derive(Clone)]
pub struct TagKey([u8; 32]);

impl TagKey {
    pub fn from_secret(secret: &[u8]) -> TagKey {
        let mut h = Sha256::new_with_prefix(b"ratewall/tag-key\0");
        h.update(secret);
        TagKey(h.finalize().into())
    }

    /// The 8 hex digits `digest` is shown by.
    pub fn tag(&self, digest: &IdentityDigest) -> ShortHex {
        let mut h = Sha256::new_with_prefix(self.0);
        h.update(digest.0);
        let full: [u8; 32] = h.finalize().into();
        let mut first = [0u8; 16];
        first[..4].copy_from_slice(&full[..4]);
        IdentityDigest(first).short_hex()
    }
}

impl std::fmt::Debug for TagKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TagKey(..)")
    }
}

/// The process's tags: the key once known (set once, at start or once a shared store
/// answered), `--------` before.
#[derive(Debug, Default)]
pub struct Tags(OnceLock<TagKey>);

impl IdentityDigest {
    /// The tag this identity is shown by, here and on every gateway of the deployment:
    /// keyed by its secret, never the digest's own digits (those name Redis keys).
    pub fn tag(&self) -> ShortHex {
        PROCESS.tag(self)
    }
}

impl Tags {
    /// Tags made with `key` from the start.
    pub fn with(key: TagKey) -> Tags {
        let tags = Tags::default();
        tags.set(key);
        tags
    }

    /// Set the key; a second call changes nothing (every tag of a process is made alike).
    pub fn set(&self, key: TagKey) {
        let _ = self.0.set(key);
    }

    pub fn is_known(&self) -> bool {
        self.0.get().is_some()
    }

    pub fn tag(&self, digest: &IdentityDigest) -> ShortHex {
        self.0.get().map_or(UNKNOWN, |k| k.tag(digest))
    }
}

/// 32 random bytes from the operating system, as 64 hex digits: a new secret.
pub fn fresh_secret() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| "the operating system gave no random bytes".to_string())?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Where the secret of a gateway on an in-process store is kept: beside the keys file,
/// else beside the config.
pub fn secret_file(keys_file: Option<&Path>, config: &Path) -> PathBuf {
    let beside = keys_file.unwrap_or(config);
    beside
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .join(SECRET_FILE)
}

/// The secret kept at `path`, made (mode 0600, created exclusively: two gateways starting
/// at once keep one) when there is none. `Err` says why it can be neither read nor made.
pub fn kept_secret(path: &Path) -> Result<String, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => return checked(text.trim(), path),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("cannot read {}: {e}", path.display()))
        }
        Err(_) => {}
    }
    let secret = fresh_secret()?;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    match options.open(path) {
        Ok(mut f) => {
            f.write_all(format!("{secret}\n").as_bytes())
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Ok(secret)
        }
        // Another gateway made it first: its secret is the one.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            checked(text.trim(), path)
        }
        Err(e) => Err(format!("cannot create {}: {e}", path.display())),
    }
}

/// The secret kept at `path`, if there is a sound one (read, never made).
pub fn existing_secret(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    checked(text.trim(), path).ok()
}

/// A kept secret must be what [`fresh_secret`] makes (a file cut short or edited is an
/// error, not a weaker key).
fn checked(text: &str, path: &Path) -> Result<String, String> {
    if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{} is not 64 hex digits; remove it to have a new secret made (tags change)",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{digest_api_key, digest_ip};

    #[test]
    fn a_tag_is_keyed_the_same_everywhere_and_not_the_digests_start() {
        let d = digest_ip("203.0.113.7".parse().unwrap());
        let a = TagKey::from_secret(b"one deployment's secret");
        let b = TagKey::from_secret(b"one deployment's secret");
        let other = TagKey::from_secret(b"another deployment's");
        assert_eq!(a.tag(&d), b.tag(&d));
        assert_ne!(a.tag(&d), other.tag(&d));
        assert_ne!(a.tag(&d), d.short_hex());
        assert_ne!(a.tag(&d), a.tag(&digest_api_key(b"203.0.113.7")));
        assert!(a
            .tag(&d)
            .as_str()
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }

    /// The attack issue 42 measured: hash every address of a network and look for the
    /// tag the status page shows. Unkeyed, the address comes back; keyed, no address of
    /// the 65,536 matches (by chance, one in 65,536 would).
    #[test]
    fn hashing_every_address_finds_nothing_without_the_secret() {
        let victim: std::net::IpAddr = "10.7.201.33".parse().unwrap();
        let key = TagKey::from_secret(b"a deployment's secret");
        let shown = key.tag(&digest_ip(victim));
        let search = |tag: ShortHex| -> Vec<std::net::IpAddr> {
            (0..=u16::MAX)
                .map(|i| std::net::IpAddr::from([10, 7, (i >> 8) as u8, i as u8]))
                .filter(|ip| digest_ip(*ip).short_hex() == tag)
                .collect()
        };
        assert_eq!(
            search(digest_ip(victim).short_hex()),
            vec![victim],
            "unkeyed: found"
        );
        assert_eq!(
            search(shown),
            Vec::<std::net::IpAddr>::new(),
            "keyed: nothing"
        );
    }

    #[test]
    fn until_the_key_is_known_a_tag_says_so() {
        let tags = Tags::default();
        let d = digest_api_key(b"k");
        assert_eq!(tags.tag(&d).as_str(), "--------");
        let key = TagKey::from_secret(b"s");
        tags.set(key.clone());
        tags.set(TagKey::from_secret(b"another"));
        assert_eq!(tags.tag(&d), key.tag(&d));
    }

    #[test]
    fn a_kept_secret_is_made_once_then_read_and_a_bad_one_is_an_error() {
        let dir = std::env::temp_dir().join(format!("ratewall-tag-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = secret_file(Some(&dir.join("keys.toml")), Path::new("x.toml"));
        assert_eq!(path, dir.join(SECRET_FILE));
        let _ = std::fs::remove_file(&path);
        let made = kept_secret(&path).expect("made");
        assert_eq!(made.len(), 64);
        assert_eq!(kept_secret(&path).expect("read"), made);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(&path, "short\n").unwrap();
        assert!(kept_secret(&path)
            .unwrap_err()
            .contains("not 64 hex digits"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            secret_file(None, Path::new("limits.toml")),
            Path::new(".").join(SECRET_FILE)
        );
    }
}
