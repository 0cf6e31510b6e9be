//! The gRPC status codes as ratewall counts and logs them: a gRPC call's outcome
//! (`ratewall_grpc_responses_total{code, source}`, the access log's `grpc_status`), and
//! which HTTP status a gateway's own gRPC answer stands for.

use http::StatusCode;

use super::label_enum;

label_enum! {
    /// The gRPC status codes (grpc/doc/statuscodes.md), each labelled by its number
    /// (`ratewall_grpc_responses_total{code}`, the access log's `grpc_status`). Declared
    /// in order: `code as u8` is its number.
    pub enum Code {
        Ok = "0",
        Cancelled = "1",
        /// What the gateway answers to an HTTP status the table does not name.
        Unknown = "2",
        InvalidArgument = "3",
        /// 504: the upstream did not answer within its `timeout`.
        DeadlineExceeded = "4",
        NotFound = "5",
        AlreadyExists = "6",
        /// 403.
        PermissionDenied = "7",
        /// 429: a rule denied the call.
        ResourceExhausted = "8",
        FailedPrecondition = "9",
        Aborted = "10",
        OutOfRange = "11",
        /// 404: no route fits the call (the service is not served here).
        Unimplemented = "12",
        /// 400, 408, 413, 431: the request was malformed or incomplete.
        Internal = "13",
        /// 502 and 503: the upstream or the rate-limit store failed.
        Unavailable = "14",
        DataLoss = "15",
        /// 401: no key, or one the gateway does not know.
        Unauthenticated = "16",
    }
}

impl Code {
    /// The gRPC status of the gateway's own answer of HTTP `status`.
    pub fn of_status(status: StatusCode) -> Code {
        match status.as_u16() {
            429 => Code::ResourceExhausted,
            401 => Code::Unauthenticated,
            502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            400 | 408 | 413 | 431 => Code::Internal,
            404 => Code::Unimplemented,
            403 => Code::PermissionDenied,
            _ => Code::Unknown,
        }
    }

    /// A `grpc-status` value as a client reads it: a number, 0 to 16; any other number,
    /// or what is no number, is UNKNOWN (2).
    pub fn parse(value: &[u8]) -> Code {
        std::str::from_utf8(value)
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .and_then(|n| Code::ALL.get(n).copied())
            .unwrap_or(Code::Unknown)
    }

    /// Its number.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// The HTTP status a gateway's gRPC answer of this code stands for (its request's
    /// outcome and status class are counted by it): the inverse of [`Code::of_status`],
    /// where UNAVAILABLE is a failed upstream's 502 for a request that was `forwarded`,
    /// else a failed store's 503, and INTERNAL a 400.
    pub fn stands_for(self, forwarded: bool) -> u16 {
        match self {
            Code::ResourceExhausted => 429,
            Code::Unauthenticated => 401,
            Code::Unavailable if forwarded => 502,
            Code::Unavailable => 503,
            Code::DeadlineExceeded => 504,
            Code::Internal => 400,
            Code::Unimplemented => 404,
            Code::PermissionDenied => 403,
            _ => 501,
        }
    }
}

label_enum! {
    /// Who wrote a gRPC answer (`ratewall_grpc_responses_total{source}`).
    pub enum Origin {
        /// The gateway itself: a denial, a refusal, a failed store or upstream.
        Gateway,
        /// The backend, passed on.
        Upstream,
    }
}
