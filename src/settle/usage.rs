//! Placeholder replaced by the usage scanner's branch (issue 27 part 4).

/// Which usage count settles the charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageField {
    TotalTokens,
    PromptTokens,
    CompletionTokens,
}
