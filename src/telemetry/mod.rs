//! The bottom layer of the metrics: what every module's metrics are made with.
//!
//! - `metrics!`: a module's metrics declared once, as one list of fields, each with its
//!   metric name, help text and kind; the macro writes the struct and its `register`.
//! - `label_sets!`: the label sets the families count by, as plain structs.
//! - `label_enum!`: a vocabulary enum written once with its label values.
//! - [`Gauged`]: a gauge held one higher while a guard lives.
//! - [`stats`]: what the status page shows, counted beside the metrics.
//! - [`AdminMetrics`] (`admin.rs`): the admin listener's, declared here so that the
//!   registry root (`runtime::Metrics`, below the admin listener) can hold them.
//!
//! The metrics themselves are declared by the module that owns them, in a struct of its
//! own beside its code (`ConnectionMetrics` in `connection/`, `GatewayMetrics` in
//! `runtime/requests.rs`, `LimiterMetrics` in `limiter/`, `UpstreamTlsMetrics` in `upstream/tls.rs`,
//! `PoolMetrics` in `upstream/metrics.rs`), and held, with the one registry, by
//! `runtime::Metrics`. Label sets are bounded: rule names (from the config), fixed enums,
//! status classes. Never an API key, never an IP. Every series a config implies exists
//! from the moment it loads, at zero (rules added by a reload at theirs), so that an
//! alert's query answers 0 rather than nothing. The request path counts through handles
//! resolved beforehand: no label is hashed and nothing is allocated per request.
//!
//! It imports no other module of the crate but `identity` (the status page's heavy
//! hitters are kept by [`crate::identity::IdentityDigest`]).

mod admin;
pub mod disposition;
pub mod grpc;
pub mod stats;

pub use admin::{AdminFailureLabels, AdminMetrics};
pub use disposition::Disposition;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

/// The bucket bounds of a request's time to an upstream's answer, in seconds: 0.5 ms to 30 s.
pub const LATENCY_BUCKETS: [f64; 15] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// One module's metrics, declared once: a list of fields, each with its metric name, help
/// text and kind. The macro writes the struct (its attributes, derives and docs kept) and
/// `register(&mut Registry) -> Self`, which registers each metric in the order written —
/// the order `/metrics` shows them in. Written as a table, a metric a line (its options
/// below it). A field is one of:
///
/// - `field: Type = ("name", "help")`: a metric (a counter, a gauge, a family of them)
///   made by `Default` and registered as `name` (the registry adds its prefix, and
///   `_total` to a counter); with `, buckets = B` after the help, a histogram or a family
///   of them with the bounds `B` (a constant: it is read in a closure that captures
///   nothing); with `, zero = LABELS` last, every label set of `LABELS` created at zero.
/// - `field: Type = nested`: another module's metrics, registered here, in this place,
///   by their own `register`.
/// - `field: Type = { expr }`: not registered; made after the fields above it, which
///   `expr` may name (handles resolved from a family, a lock).
///
/// ```ignore
/// crate::telemetry::metrics! {
///     #[derive(Clone)]
///     pub struct TunnelMetrics {
///         pub open: Family<TunnelLabels, Gauge> = ("upgraded_connections", "Open now"),
///         pub ended: Family<EndedLabels, Counter> = ("upgraded_closed", "Closed, by reason",
///             zero = Ended::ALL.map(|reason| EndedLabels { reason }),
///         ),
///         handles: [Gauge; 2] = { [open.get_or_create(..).clone(), ..] },
///     }
/// }
/// ```
macro_rules! metrics {
    (@make $registry:ident, $ty:ty, nested) => {
        <$ty>::register($registry)
    };
    (@make $registry:ident, $ty:ty, { $($made:tt)* }) => {
        { $($made)* }
    };
    (@make $registry:ident, $ty:ty, (
        $metric:literal, $help:literal $(, buckets = $buckets:expr)? $(, zero = $zero:expr)? $(,)?
    )) => {{
        let made = $crate::telemetry::metrics!(@new $ty $(, $buckets)?);
        $(
            for labels in $zero {
                let _ = made.get_or_create(&labels);
            }
        )?
        $registry.register($metric, $help, made.clone());
        made
    }};
    (@new $ty:ty) => {
        <$ty as Default>::default()
    };
    (@new $ty:ty, $buckets:expr) => {
        <$ty as $crate::telemetry::Buckets>::with(|| {
            prometheus_client::metrics::histogram::Histogram::new($buckets)
        })
    };
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $($(#[$fmeta:meta])* $fvis:vis $field:ident : $fty:ty = $init:tt),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $($(#[$fmeta])* $fvis $field: $fty),+
        }

        impl $name {
            /// Register these metrics in `registry`, in the order declared, and every
            /// series declared at zero.
            pub fn register(registry: &mut prometheus_client::registry::Registry) -> $name {
                $(let $field: $fty = $crate::telemetry::metrics!(@make registry, $fty, $init);)+
                $name { $($field),+ }
            }
        }
    };
}
pub(crate) use metrics;

/// Label sets, written as plain structs: each gets what a family's labels need (`Clone`,
/// `Debug`, `Hash`, `Eq`, and its encoding, one label a field, in the order written).
///
/// ```ignore
/// crate::telemetry::label_sets! {
///     pub struct PoolLabels {
///         pub pool: String,
///     }
/// }
/// ```
macro_rules! label_sets {
    ($(
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $($(#[$fmeta:meta])* $fvis:vis $field:ident : $fty:ty),+ $(,)?
        }
    )+) => {$(
        $(#[$meta])*
        #[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
        $vis struct $name {
            $($(#[$fmeta])* $fvis $field: $fty),+
        }
    )+};
}
pub(crate) use label_sets;

/// A histogram, or a family of them, made with its buckets (by `metrics!`).
pub trait Buckets {
    fn with(make: fn() -> Histogram) -> Self;
}

impl Buckets for Histogram {
    fn with(make: fn() -> Histogram) -> Self {
        make()
    }
}

impl<L: Clone + std::hash::Hash + Eq> Buckets for Family<L, Histogram> {
    fn with(make: fn() -> Histogram) -> Self {
        Family::new_with_constructor(make)
    }
}

/// One vocabulary enum (a decision, an outcome, a reason), written once with the label
/// value of each variant: its name in snake_case (`BreakerOpen` is `breaker_open`, as
/// serde's `rename_all = "snake_case"` says it), or `Variant = "value"` where the value is
/// another. The enum comes out as written (its attributes and docs kept) with the derives
/// every label needs (`Clone, Copy, Debug, Hash, PartialEq, Eq`; derive any other
/// beside them), `ALL` (every variant, in declaration order), `name()` (the value:
/// metrics, logs and the config all say it so) and its encoding as a Prometheus label
/// value.
///
/// ```ignore
/// crate::telemetry::label_enum! {
///     pub enum UpstreamFailure {
///         Error = "upstream_error",
///         TimedOut,
///     }
/// }
/// ```
macro_rules! label_enum {
    (@label $variant:ident) => {{
        const NAME: &str = stringify!($variant);
        const BYTES: [u8; $crate::telemetry::snake_case_len(NAME)] =
            $crate::telemetry::snake_case(NAME);
        const LABEL: &str = match std::str::from_utf8(&BYTES) {
            Ok(label) => label,
            Err(_) => panic!("a variant's name is UTF-8"),
        };
        LABEL
    }};
    (@label $variant:ident $label:literal) => {
        $label
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident $(= $label:literal)?),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
        $vis enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];

            /// The value as metrics, logs and the config name it.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $crate::telemetry::label_enum!(@label $variant $($label)?)),+
                }
            }
        }

        impl prometheus_client::encoding::EncodeLabelValue for $name {
            fn encode(
                &self,
                e: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
            ) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(e, self.name())
            }
        }
    };
}
pub(crate) use label_enum;

/// How long `name` is in snake_case: one byte more for each capital after the first.
pub const fn snake_case_len(name: &str) -> usize {
    let bytes = name.as_bytes();
    let mut len = bytes.len();
    let mut i = 1;
    while i < bytes.len() {
        if bytes[i].is_ascii_uppercase() {
            len += 1;
        }
        i += 1;
    }
    len
}

/// `name` in snake_case (`N` its [`snake_case_len`]): `_` before each capital after the
/// first, every capital lower-cased — `label_enum!`'s label of a variant, at compile time.
pub const fn snake_case<const N: usize>(name: &str) -> [u8; N] {
    let bytes = name.as_bytes();
    let mut out = [0; N];
    let (mut i, mut o) = (0, 0);
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_uppercase() {
            if i > 0 {
                out[o] = b'_';
                o += 1;
            }
            out[o] = b.to_ascii_lowercase();
        } else {
            out[o] = b;
        }
        o += 1;
        i += 1;
    }
    out
}

/// A guard that holds a gauge one higher until dropped (requests in flight, waiting).
pub struct Gauged<'a>(&'a Gauge);

impl<'a> Gauged<'a> {
    pub fn new(g: &'a Gauge) -> Self {
        g.inc();
        Gauged(g)
    }
}

impl Drop for Gauged<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::{Family, Histogram};
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::registry::Registry;

    label_enum! {
        enum Sample {
            One,
            TwoWords,
        }
    }

    label_enum! {
        enum Named {
            Derived,
            /// A value of its own.
            Given = "given_value",
            S2xx = "2xx",
            ThreeWordsHere,
        }
    }

    #[test]
    fn a_label_is_the_variants_name_in_snake_case_unless_given() {
        let names = Named::ALL.map(Named::name);
        assert_eq!(names, ["derived", "given_value", "2xx", "three_words_here"]);
    }

    #[test]
    fn snake_case_marks_each_capital_after_the_first() {
        fn snake<const N: usize>(name: &str) -> String {
            assert_eq!(super::snake_case_len(name), N);
            String::from_utf8(super::snake_case::<N>(name).to_vec()).expect("UTF-8")
        }
        assert_eq!(snake::<2>("Ok"), "ok");
        assert_eq!(snake::<12>("BreakerOpen"), "breaker_open");
        assert_eq!(snake::<4>("S2xx"), "s2xx");
        assert_eq!(snake::<8>("HTTPa"), "h_t_t_pa");
        assert_eq!(snake::<5>("lower"), "lower");
    }

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct SampleLabels {
        sample: Sample,
    }

    #[test]
    fn a_label_enum_lists_its_variants_names_them_and_encodes_the_names() {
        assert_eq!(Sample::ALL, [Sample::One, Sample::TwoWords]);
        assert_eq!(Sample::TwoWords.name(), "two_words");
        let mut registry = Registry::default();
        let family = Family::<SampleLabels, Counter>::default();
        registry.register("samples", "Samples", family.clone());
        family
            .get_or_create(&SampleLabels {
                sample: Sample::TwoWords,
            })
            .inc();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        assert!(
            text.contains("samples_total{sample=\"two_words\"} 1"),
            "{text}"
        );
    }

    label_sets! {
        struct DeclaredLabels {
            rule: &'static str,
            sample: Sample,
        }
    }

    metrics! {
        struct Inner {
            inner: Counter = ("inner", "Inner"),
        }
    }

    metrics! {
        struct Declared {
            family: Family<DeclaredLabels, Counter> = ("declared", "Declared",
                zero = Sample::ALL.map(|sample| DeclaredLabels { rule: "r", sample }),
            ),
            wait: Histogram = ("wait_seconds", "Waits", buckets = [0.5, 1.0]),
            nested: Inner = nested,
            handle: Counter = {
                family.get_or_create(&DeclaredLabels { rule: "r", sample: Sample::One }).clone()
            },
        }
    }

    #[test]
    fn declared_metrics_register_in_order_with_their_buckets_and_series_at_zero() {
        let mut registry = Registry::default();
        let m = Declared::register(&mut registry);
        m.handle.inc();
        m.wait.observe(0.7);
        m.nested.inner.inc();
        let two = DeclaredLabels {
            rule: "r",
            sample: Sample::TwoWords,
        };
        assert_eq!(m.family.get_or_create(&two).get(), 0);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        let at = |line: &str| {
            text.find(line)
                .unwrap_or_else(|| panic!("no {line} in {text}"))
        };
        assert!(at("# HELP declared Declared") < at("# HELP wait_seconds Waits"));
        assert!(at("# HELP wait_seconds Waits") < at("# HELP inner Inner"));
        at("declared_total{rule=\"r\",sample=\"one\"} 1");
        at("declared_total{rule=\"r\",sample=\"two_words\"} 0");
        at("wait_seconds_bucket{le=\"0.5\"} 0");
        at("wait_seconds_bucket{le=\"1.0\"} 1");
        at("inner_total 1");
    }
}
