//! What every module's metrics are made with: `label_enum!`, which writes a vocabulary
//! enum once with its label values, and [`Gauged`].
//!
//! The metrics themselves are registered by the module that owns them, in a struct of
//! its own beside its code (`ConnectionMetrics` in `connection/`, `GatewayMetrics` in
//! `gateway/`, `LimiterMetrics` in `limiter/`, `UpstreamTlsMetrics` in `upstream/tls.rs`,
//! `PoolMetrics` in `upstream/metrics.rs`), and held, with the one registry, by
//! [`crate::proxy::Metrics`]. Label sets are bounded: rule names (from the config),
//! fixed enums, status classes. Never an API key, never an IP. Every series a config
//! implies exists from the moment it loads, at zero (rules added by a reload at theirs),
//! so that an alert's query answers 0 rather than nothing. The request path counts
//! through handles resolved beforehand: no label is hashed and nothing is allocated per
//! request.

use prometheus_client::metrics::gauge::Gauge;

/// One vocabulary enum (a decision, an outcome, a reason), written once with the label
/// value of each variant: `Variant = "value"`. The enum comes out as written (its
/// attributes, derives and docs kept; derive `Clone, Copy` at least), with `ALL` (every
/// variant, in declaration order), `name()` (the value: metrics, logs and the config
/// all say it so) and its encoding as a Prometheus label value.
///
/// ```ignore
/// crate::metrics::label_enum! {
///     #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
///     pub enum ReloadResult {
///         Ok = "ok",
///         Rejected = "rejected",
///     }
/// }
/// ```
macro_rules! label_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident = $label:literal),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [$name; [$($label),+].len()] = [$($name::$variant),+];

            /// The value as metrics, logs and the config name it.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $label),+
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
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;

    label_enum! {
        #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
        enum Sample {
            One = "one",
            TwoWords = "two_words",
        }
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
}
