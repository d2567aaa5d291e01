//! Time travel: `AS OF EPOCH n`, `AS OF TIMESTAMP '...'` and `AS OF TAG name`, rewritten
//! before DataFusion parses.
//!
//! `FROM t AS OF EPOCH 42 [alias]` becomes `FROM "t@42" AS t` (or the user's alias); a
//! timestamp becomes `"t@timestamp:<ms since the Unix epoch>"` and a tag `"t@tag:<name>"`.
//! The catalog resolves those names to table `t` read at the epoch they name (a timestamp
//! through the epoch log, a tag through the tags, both in the cluster's metadata). The
//! rewrite works on tokens, so string literals and comments are never touched.

use crate::error::{Result, SqlError};
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::keywords::Keyword;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer, Whitespace, Word};

/// The separator between a table name and its time-travel point in catalog names.
pub const EPOCH_SEPARATOR: char = '@';
const TIMESTAMP_PREFIX: &str = "timestamp:";
const TAG_PREFIX: &str = "tag:";

/// The point in a table's history a query reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsOf {
    Epoch(u64),
    /// Milliseconds since the Unix epoch, UTC: the newest epoch visible at that time.
    Timestamp(u64),
    Tag(String),
}

impl AsOf {
    /// The suffix of a catalog name after [`EPOCH_SEPARATOR`].
    fn encode(&self) -> String {
        match self {
            AsOf::Epoch(epoch) => epoch.to_string(),
            AsOf::Timestamp(ms) => format!("{TIMESTAMP_PREFIX}{ms}"),
            AsOf::Tag(name) => format!("{TAG_PREFIX}{name}"),
        }
    }

    fn decode(text: &str) -> Option<AsOf> {
        if let Some(ms) = text.strip_prefix(TIMESTAMP_PREFIX) {
            return Some(AsOf::Timestamp(ms.parse().ok()?));
        }
        if let Some(name) = text.strip_prefix(TAG_PREFIX) {
            return Some(AsOf::Tag(name.to_string()));
        }
        Some(AsOf::Epoch(text.parse().ok()?))
    }
}

/// Refuses a timestamp later than now: the epochs of that time are not decided yet, and an
/// answer for it would change as they are.
pub fn refuse_future(point: &AsOf) -> crate::error::Result<()> {
    let AsOf::Timestamp(at_ms) = point else {
        return Ok(());
    };
    let now_ms = tessera_common::time::now_ms();
    if *at_ms > now_ms {
        return Err(crate::error::SqlError::InvalidValue(format!(
            "{point} is in the future (it is {} now): its epochs are not decided yet",
            tessera_common::time::format_ms(now_ms)
        )));
    }
    Ok(())
}

impl std::fmt::Display for AsOf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AsOf::Epoch(epoch) => write!(f, "AS OF EPOCH {epoch}"),
            AsOf::Timestamp(ms) => write!(
                f,
                "AS OF TIMESTAMP '{}'",
                tessera_common::time::format_ms(*ms)
            ),
            AsOf::Tag(name) => write!(f, "AS OF TAG {name}"),
        }
    }
}

/// Splits a catalog name `t@42` (or `t@timestamp:..`, `t@tag:..`) into the table and the
/// point it is read at.
pub fn split_as_of(name: &str) -> Option<(&str, AsOf)> {
    let (table, point) = name.rsplit_once(EPOCH_SEPARATOR)?;
    Some((table, AsOf::decode(point)?))
}

/// The table a catalog name reads, with or without a time-travel point.
pub fn base_table_name(name: &str) -> &str {
    split_as_of(name).map_or(name, |(table, _)| table)
}

fn is_word(token: &Token, text: &str) -> bool {
    matches!(token, Token::Word(w) if w.quote_style.is_none() && w.value.eq_ignore_ascii_case(text))
}

/// A time-travel timestamp: an ISO 8601 date and time (`2026-11-20 10:00`,
/// `2026-11-20T10:00:00.5+01:00`, a date alone is midnight), UTC unless it names an offset.
pub fn parse_timestamp_ms(text: &str) -> Result<u64> {
    let text = text.trim();
    // Arrow's parser wants seconds; `10:00` means `10:00:00`.
    let bytes = text.as_bytes();
    let without_seconds = bytes.len() >= 16
        && text.is_char_boundary(16)
        && bytes[13] == b':'
        && bytes
            .get(16)
            .is_none_or(|b| *b != b':' && !b.is_ascii_digit());
    let text = if without_seconds {
        format!("{}:00{}", &text[..16], &text[16..])
    } else {
        text.to_string()
    };
    let utc: arrow::array::timezone::Tz = "+00:00".parse().expect("UTC is a time zone");
    let time = arrow::compute::kernels::cast_utils::string_to_datetime(&utc, &text).map_err(|e| {
        SqlError::InvalidDatetime(format!(
            "AS OF TIMESTAMP needs a date and time such as '2026-11-20 10:00' (UTC unless an offset is given): {e}"
        ))
    })?;
    u64::try_from(time.timestamp_millis()).map_err(|_| {
        SqlError::InvalidValue(format!(
            "AS OF TIMESTAMP '{text}' is before 1970, before any epoch"
        ))
    })
}

/// What follows `AS OF`: the point, and how many significant tokens it took.
fn parse_point(kind: &Token, value: Option<&Token>) -> Result<AsOf> {
    let shown = |t: Option<&Token>| t.map_or_else(|| "end of statement".into(), |t| t.to_string());
    if is_word(kind, "EPOCH") {
        return match value {
            Some(Token::Number(n, _)) => n.parse::<u64>().map(AsOf::Epoch).map_err(|_| {
                SqlError::Syntax(format!("AS OF EPOCH needs a whole epoch number, got {n}"))
            }),
            other => Err(SqlError::Syntax(format!(
                "AS OF EPOCH needs an epoch number, got {}",
                shown(other)
            ))),
        };
    }
    if is_word(kind, "TIMESTAMP") {
        return match value {
            Some(Token::SingleQuotedString(text)) => parse_timestamp_ms(text).map(AsOf::Timestamp),
            other => Err(SqlError::Syntax(format!(
                "AS OF TIMESTAMP needs a quoted date and time such as '2026-11-20 10:00', got {}",
                shown(other)
            ))),
        };
    }
    match value {
        Some(Token::Word(word)) if word.quote_style.is_none() || word.quote_style == Some('"') => {
            let name = if word.quote_style.is_some() {
                word.value.clone()
            } else {
                word.value.to_lowercase()
            };
            crate::tags::check_tag_name(&name)?;
            Ok(AsOf::Tag(name))
        }
        other => Err(SqlError::Syntax(format!(
            "AS OF TAG needs a tag name, got {}",
            shown(other)
        ))),
    }
}

/// Rewrites every `AS OF EPOCH | TIMESTAMP | TAG` clause; SQL without one is returned
/// unchanged.
pub fn rewrite_as_of(sql: &str) -> Result<String> {
    let upper = sql.to_ascii_uppercase();
    if !(upper.contains("EPOCH") || upper.contains("TIMESTAMP") || upper.contains("TAG")) {
        return Ok(sql.to_string());
    }
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .with_unescape(false)
        .tokenize()
        .map_err(|e| {
            SqlError::DataFusion(datafusion::error::DataFusionError::SQL(
                Box::new(e.into()),
                None,
            ))
        })?;
    let significant: Vec<usize> = (0..tokens.len())
        .filter(|&i| !matches!(tokens[i], Token::Whitespace(_)))
        .collect();
    let mut out: Vec<Token> = Vec::with_capacity(tokens.len());
    let mut skip_until = 0;
    let mut rewritten = false;
    for (pos, &i) in significant.iter().enumerate() {
        if i < skip_until {
            continue;
        }
        let at = |offset: usize| significant.get(pos + offset).map(|&j| &tokens[j]);
        let is_clause = is_word(&tokens[i], "AS")
            && at(1).is_some_and(|t| is_word(t, "OF"))
            && at(2).is_some_and(|t| {
                is_word(t, "EPOCH") || is_word(t, "TIMESTAMP") || is_word(t, "TAG")
            });
        if !is_clause {
            // Copy this token and the whitespace after it.
            let end = significant.get(pos + 1).copied().unwrap_or(tokens.len());
            out.extend(tokens[i..end].iter().cloned());
            continue;
        }
        let kind = at(2).expect("checked above");
        let point = parse_point(kind, at(3))?;
        // The table name is the last word emitted (after trailing whitespace).
        while matches!(out.last(), Some(Token::Whitespace(_))) {
            out.pop();
        }
        let Some(Token::Word(table)) = out.pop() else {
            return Err(SqlError::Syntax(format!(
                "AS OF {kind} must follow a table name"
            )));
        };
        let plain_name = if table.quote_style.is_some() {
            table.value.clone()
        } else {
            table.value.to_lowercase()
        };
        out.push(quoted(format!(
            "{plain_name}{EPOCH_SEPARATOR}{}",
            point.encode()
        )));
        let has_alias = match at(4) {
            Some(Token::Word(w)) => w.keyword == Keyword::AS || w.keyword == Keyword::NoKeyword,
            _ => false,
        };
        if !has_alias {
            out.push(Token::Whitespace(Whitespace::Space));
            out.push(Token::Word(Word {
                value: "AS".into(),
                quote_style: None,
                keyword: Keyword::AS,
            }));
            out.push(Token::Whitespace(Whitespace::Space));
            out.push(quoted(plain_name));
        }
        out.push(Token::Whitespace(Whitespace::Space));
        skip_until = significant.get(pos + 4).copied().unwrap_or(tokens.len());
        rewritten = true;
    }
    if !rewritten {
        return Ok(sql.to_string());
    }
    Ok(out.iter().map(|t| t.to_string()).collect())
}

fn quoted(value: String) -> Token {
    Token::Word(Word {
        value,
        quote_style: Some('"'),
        keyword: Keyword::NoKeyword,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_the_clause_and_keeps_the_table_name_as_alias() {
        assert_eq!(
            rewrite_as_of("SELECT * FROM t AS OF EPOCH 3").unwrap(),
            r#"SELECT * FROM "t@3" AS "t" "#
        );
        assert_eq!(
            rewrite_as_of("select a from T as of epoch 12 x where x.a > 1").unwrap(),
            r#"select a from "t@12" x where x.a > 1"#
        );
        assert_eq!(
            rewrite_as_of("select 1 from a as of epoch 1 as b join c as of epoch 2 on b.k = c.k")
                .unwrap(),
            r#"select 1 from "a@1" as b join "c@2" AS "c" on b.k = c.k"#
        );
    }

    #[test]
    fn leaves_other_sql_alone() {
        let sql = "SELECT 'AS OF EPOCH 3' AS epoch FROM t";
        assert_eq!(rewrite_as_of(sql).unwrap(), sql);
    }

    #[test]
    fn keeps_escaped_quotes_in_a_rewritten_statement() {
        assert_eq!(
            rewrite_as_of("SELECT 'it''s' FROM t AS OF EPOCH 2").unwrap(),
            "SELECT 'it''s' FROM \"t@2\" AS \"t\" "
        );
    }

    #[test]
    fn names_bad_epochs() {
        assert!(rewrite_as_of("SELECT * FROM t AS OF EPOCH x")
            .unwrap_err()
            .to_string()
            .contains("epoch number"));
        assert!(rewrite_as_of("SELECT * FROM t AS OF EPOCH -1").is_err());
        assert_eq!(split_as_of("orders@7"), Some(("orders", AsOf::Epoch(7))));
        assert_eq!(split_as_of("orders"), None);
    }

    #[test]
    fn rewrites_timestamps_and_tags() {
        assert_eq!(
            rewrite_as_of("SELECT * FROM t AS OF TIMESTAMP '2025-11-20 10:00' x").unwrap(),
            r#"SELECT * FROM "t@timestamp:1763632800000" x"#
        );
        assert_eq!(
            rewrite_as_of("SELECT * FROM t as of tag Release_1").unwrap(),
            r#"SELECT * FROM "t@tag:release_1" AS "t" "#
        );
        assert_eq!(
            split_as_of("t@timestamp:1763632800000"),
            Some(("t", AsOf::Timestamp(1_763_632_800_000)))
        );
        assert_eq!(
            split_as_of("t@tag:release_1"),
            Some(("t", AsOf::Tag("release_1".into())))
        );
        assert_eq!(base_table_name("t@tag:release_1"), "t");
    }

    #[test]
    fn reads_timestamps_in_utc_unless_an_offset_is_given() {
        assert_eq!(
            parse_timestamp_ms("2025-11-20 10:00").unwrap(),
            1_763_632_800_000
        );
        assert_eq!(
            parse_timestamp_ms("2025-11-20T10:00:00.250").unwrap(),
            1_763_632_800_250
        );
        assert_eq!(
            parse_timestamp_ms("2025-11-20T11:00:00+01:00").unwrap(),
            1_763_632_800_000
        );
        assert_eq!(parse_timestamp_ms("2025-11-20").unwrap(), 1_763_596_800_000);
        let error = parse_timestamp_ms("yesterday").unwrap_err().to_string();
        assert!(error.contains("2026-11-20 10:00"), "{error}");
        assert!(rewrite_as_of("SELECT * FROM t AS OF TIMESTAMP 5").is_err());
        assert!(rewrite_as_of("SELECT * FROM t AS OF TAG 'x'").is_err());
    }
}
