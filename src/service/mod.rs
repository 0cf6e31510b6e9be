//! TEMPORARY scaffold on branch `rls` until main's `service` module is merged: main's
//! file replaces this one whole (keeping `pub mod rls;`).
pub mod rls;
