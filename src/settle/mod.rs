//! Settlement of reservations (issue 27).

pub mod usage;
