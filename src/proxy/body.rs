//! What a client receives: an upstream's body streamed through, holding the request's
//! concurrency slots until it ends (and, for a gRPC call, watched for its status), or an
//! answer the gateway wrote.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderName;
use http_body_util::{Either, Full};

use super::grpc::Watch;
use crate::decide::{Leases, Releasing};
use crate::settle::Meter;
use crate::upstream::ResponseBody;

/// What a client receives: the upstream's streamed body, or one the gateway wrote.
pub type Body = Either<LeasedBody, Full<Bytes>>;

/// The upstream's response body, streamed through, holding the request's concurrency slots
/// until it ends: given back as the last frame is handed on (before the client can send
/// its next request), or when the client goes away.
pub struct LeasedBody {
    body: ResponseBody,
    leases: Option<Leases>,
    /// The leases' release in a shared store, and the last frame held back until it is
    /// done (`None` inside: the end of the body). Boxed: most bodies release nothing
    /// there, and a response is moved whole between the request's phases.
    releasing: Option<Box<(Releasing, Option<hyper::body::Frame<Bytes>>)>>,
    /// A gRPC answer's watch for its trailers' `grpc-status` (gRPC calls only: boxed, so
    /// that other bodies pay one word and one check a frame).
    grpc: Option<Box<Watch>>,
    /// What reads the cost the body's end reports (rules that settle by a trailer or an
    /// LLM answer's usage); boxed, as `grpc`. Still here when the client goes away: the
    /// rest of the answer is then read on to settle it ([`Meter::drain`]).
    meter: Option<Box<Meter>>,
    /// Names the answer's trailers lose, whatever settles: every rule's cost header.
    screened: Option<Arc<[HeaderName]>>,
}

impl LeasedBody {
    pub(super) fn new(body: ResponseBody, leases: Option<Leases>) -> LeasedBody {
        LeasedBody {
            body,
            leases,
            releasing: None,
            grpc: None,
            meter: None,
            screened: None,
        }
    }

    /// Take `names` out of the answer's trailers (every rule's cost header: no client ever
    /// sees one, whether or not a rule waited for it).
    pub(super) fn screened(mut self, names: Option<Arc<[HeaderName]>>) -> LeasedBody {
        self.screened = names;
        self
    }

    /// Watch this body for the cost its end reports ([`Meter`]), if there is one to watch.
    pub(super) fn metered(mut self, meter: Option<Meter>) -> LeasedBody {
        self.meter = meter.map(Box::new);
        self
    }

    /// Watch this body for its `grpc-status` trailer ([`Watch`]).
    pub(super) fn watch(&mut self, watch: Watch) {
        self.grpc = Some(Box::new(watch));
    }
}

impl Drop for LeasedBody {
    /// The client went away before the answer's end while a cost is still to come at it:
    /// the rest is read on, in the background (within the rules' `settle_drain`), and
    /// settled; the request's concurrency slots are held until then, since the backend is
    /// still working for it.
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // A settlement (and the slots' release) begun as the body ended, its client gone
        // before it finished: it finishes on its own.
        if let Some(releasing) = self.releasing.take() {
            runtime.spawn(releasing.0);
        }
        let Some(meter) = self.meter.take() else {
            return;
        };
        let body = std::mem::replace(&mut self.body, ResponseBody::taken());
        let leases = self.leases.take();
        runtime.spawn(async move {
            meter.drain(body).await;
            drop(leases);
        });
    }
}

impl hyper::body::Body for LeasedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        if this.releasing.is_none() {
            let mut polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
            if let (Some(m), Poll::Ready(Some(Ok(frame)))) =
                (this.meter.as_deref_mut(), &mut polled)
            {
                m.frame(frame);
            }
            if let (Some(w), Poll::Ready(Some(Ok(frame)))) = (this.grpc.as_deref_mut(), &polled) {
                w.frame(frame);
            }
            if let (Some(names), Poll::Ready(Some(Ok(frame)))) = (&this.screened, &mut polled) {
                if let Some(trailers) = frame.trailers_mut() {
                    for name in names.iter() {
                        trailers.remove(name);
                    }
                }
            }
            let last = match polled {
                Poll::Ready(Some(Ok(frame))) if this.body.is_end_stream() => Some(frame),
                Poll::Ready(None) => None,
                Poll::Ready(Some(Err(e))) => {
                    this.leases = None;
                    // Cut short: the reservations stand, or the usage seen so far if it is
                    // more (settled in the background: the client is being cut too).
                    if let (Some(settle), Ok(runtime)) = (
                        this.meter.take().and_then(|m| m.cut()),
                        tokio::runtime::Handle::try_current(),
                    ) {
                        runtime.spawn(settle);
                    }
                    if let Some(w) = this.grpc.as_deref_mut() {
                        w.end();
                    }
                    return Poll::Ready(Some(Err(e)));
                }
                other => return other,
            };
            if let Some(w) = this.grpc.as_deref_mut() {
                w.end();
            }
            // The response is complete: the request is no longer in flight. Its slots
            // are given back, and what its end reported is settled, before the last bytes
            // go out (a client that has the whole answer sees both on its next request).
            let settle = this.meter.take().and_then(|m| m.finish());
            let release = this.leases.take().and_then(Leases::release);
            let finish: Option<Releasing> = match (release, settle) {
                (Some(r), Some(s)) => Some(Box::pin(async move {
                    futures_util::future::join(r, s).await;
                })),
                (Some(r), None) => Some(r),
                (None, Some(s)) => Some(s),
                (None, None) => None,
            };
            match finish {
                Some(finish) => this.releasing = Some(Box::new((finish, last))),
                None => return Poll::Ready(last.map(Ok)),
            }
        }
        match &mut this.releasing {
            Some(releasing) => {
                if releasing.0.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            None => return Poll::Ready(None),
        }
        let last = this.releasing.take().and_then(|releasing| releasing.1);
        Poll::Ready(last.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        // Not while slots remain to give back: hyper then polls once more, and the
        // release runs before the response is over (an empty body included).
        self.leases.is_none()
            && self.meter.is_none()
            && self.releasing.is_none()
            && self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
