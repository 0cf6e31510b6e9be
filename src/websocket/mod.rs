//! WebSocket (RFC 6455), as far as a gateway that passes frames through unchanged needs
//! it: where frames begin and end, how large a message is, and how many data frames and
//! payload bytes a client sends.
//!
//! - [`frame`]: an exact, bounded, streaming scanner of §5 frames, one per direction of a
//!   socket (it never buffers a payload), and the close frames the gateway writes itself.
//! - [`meter`]: a rule's `messages = { rate, burst }` and `bytes = { rate, burst }`, each
//!   one bucket per identity shared by its sockets (and, through the store, by gateways),
//!   charged in batches.
//!
//! The copy loop that uses them lives with the upgraded connection (`src/tunnel/`): scan
//! the client's bytes with the meters' tokens, pass what the scan passed, spend its frames
//! and bytes, drop what it drops, and refill (or hold the client back) when it stops for
//! want of a token.

pub mod frame;
pub mod meter;

pub use frame::{close_frame, Budget, Scan, Scanner, Side, Stop, Violation};
pub use meter::{Meter, Refill, Unit};
