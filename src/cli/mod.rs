//! `ratewall check`, whole: the file validated and described ([`describe`]), and with a
//! sample request, the way the request path would take it ([`explain`]). What the
//! subcommand prints, and in which order, is [`check`].

mod check;
mod describe;
mod explain;

pub use check::{check, Sample};
pub use describe::describe;
pub use explain::explain;
