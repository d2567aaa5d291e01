//! `ALTER TABLE t SET (retain_epochs = n, retain_for = '7 days')` and `ALTER TABLE t
//! RESET (retain_epochs, retain_for)`: how much of a table's history is kept. Merges then
//! drop the versions no retained epoch (or tag) can see, and reads below the table's
//! retention horizon are refused, naming it.

use crate::error::{Result, SqlError};
use crate::statements::{describe, syntax, Tokens};
use datafusion::sql::sqlparser::keywords::Keyword;
use datafusion::sql::sqlparser::tokenizer::Token;

pub const RETAIN_EPOCHS: &str = "retain_epochs";
pub const RETAIN_FOR: &str = "retain_for";
/// `archive = true`: every version retention passes goes to the erasure-coded archive.
pub const ARCHIVE: &str = "archive";

/// A parsed retention change: for each option, `None` leaves it as it is, `Some(None)`
/// resets it (keep every version), `Some(Some(v))` sets it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RetentionStatement {
    pub table: String,
    pub epochs: Option<Option<u64>>,
    /// Milliseconds.
    pub for_ms: Option<Option<u64>>,
    /// `archive = true|false` (RESET: false).
    pub archive: Option<bool>,
}

impl RetentionStatement {
    pub fn command_tag(&self) -> &'static str {
        "ALTER TABLE"
    }
}

impl std::fmt::Display for RetentionStatement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut set = Vec::new();
        let mut reset = Vec::new();
        match self.epochs {
            Some(Some(n)) => set.push(format!("{RETAIN_EPOCHS} = {n}")),
            Some(None) => reset.push(RETAIN_EPOCHS),
            None => {}
        }
        match self.for_ms {
            Some(Some(ms)) => set.push(format!("{RETAIN_FOR} = '{ms} milliseconds'")),
            Some(None) => reset.push(RETAIN_FOR),
            None => {}
        }
        if let Some(archive) = self.archive {
            set.push(format!("{ARCHIVE} = {archive}"));
        }
        write!(f, "ALTER TABLE {}", self.table)?;
        if !set.is_empty() {
            write!(f, " SET ({})", set.join(", "))?;
        }
        if !reset.is_empty() {
            write!(f, " RESET ({})", reset.join(", "))?;
        }
        Ok(())
    }
}

/// `Some` if `sql` is `ALTER TABLE name SET (...)` or `RESET (...)`, parsed or with the
/// error that names what is wrong; `None` for any other SQL (other `ALTER TABLE` forms
/// included).
pub fn parse_retention_statement(sql: &str) -> Option<Result<RetentionStatement>> {
    let mut tokens = Tokens::of(sql)?;
    if !tokens.keywords(&[Keyword::ALTER, Keyword::TABLE]) {
        return None;
    }
    let table = tokens.name("a table name").ok()?;
    let verb = tokens.keyword_of(&[Keyword::SET, Keyword::RESET])?;
    if tokens.peek() != Some(&Token::LParen) {
        return None;
    }
    Some(tokens.retention_options(table, verb == Keyword::SET))
}

impl Tokens {
    fn retention_options(&mut self, table: String, set: bool) -> Result<RetentionStatement> {
        self.expect(&Token::LParen, "'('")?;
        let mut statement = RetentionStatement {
            table,
            ..Default::default()
        };
        loop {
            let option = self.name("a table option")?;
            if option == ARCHIVE {
                if statement.archive.is_some() {
                    return Err(syntax(format!("option {option} is given twice")));
                }
                statement.archive = Some(set && self.archive_value()?);
            } else {
                let value = if set {
                    self.expect(&Token::Eq, &format!("'=' after {option}"))?;
                    Some(self.option_value(&option)?)
                } else {
                    None
                };
                let slot = match option.as_str() {
                RETAIN_EPOCHS => &mut statement.epochs,
                RETAIN_FOR => &mut statement.for_ms,
                other => {
                    return Err(SqlError::InvalidValue(format!(
                        "unknown table option {other:?}: the options are {RETAIN_EPOCHS}, {RETAIN_FOR} and {ARCHIVE}"
                    )))
                }
            };
                if slot.is_some() {
                    return Err(syntax(format!("option {option} is given twice")));
                }
                *slot = Some(value);
            }
            match self.peek() {
                Some(Token::Comma) => self.at += 1,
                Some(Token::RParen) => {
                    self.at += 1;
                    break;
                }
                other => {
                    return Err(syntax(format!(
                        "expected ',' or ')' in the table options, found {}",
                        describe(other)
                    )))
                }
            }
        }
        self.end("ALTER TABLE")?;
        Ok(statement)
    }

    /// `= true` or `= false` after `archive`.
    fn archive_value(&mut self) -> Result<bool> {
        self.expect(&Token::Eq, &format!("'=' after {ARCHIVE}"))?;
        let value = match self.peek() {
            Some(Token::Word(word)) if word.value.eq_ignore_ascii_case("true") => true,
            Some(Token::Word(word)) if word.value.eq_ignore_ascii_case("false") => false,
            other => {
                return Err(syntax(format!(
                    "expected true or false for {ARCHIVE}, found {}",
                    describe(other)
                )))
            }
        };
        self.at += 1;
        Ok(value)
    }

    /// `retain_epochs = 3`, `retain_for = '7 days'`.
    fn option_value(&mut self, option: &str) -> Result<u64> {
        match option {
            RETAIN_EPOCHS => {
                let n = self.number("a number of epochs")?;
                if n == 0 {
                    return Err(SqlError::InvalidValue(
                        "retain_epochs must be at least 1 (the table's current version); RESET (retain_epochs) keeps every version"
                            .into(),
                    ));
                }
                Ok(n)
            }
            RETAIN_FOR => match self.peek().cloned() {
                Some(Token::SingleQuotedString(text)) => {
                    self.at += 1;
                    parse_duration_ms(&text)
                }
                other => Err(syntax(format!(
                    "expected a duration such as '7 days' for {RETAIN_FOR}, found {}",
                    describe(other.as_ref())
                ))),
            },
            // Named by the caller's error.
            _ => self.number("a value"),
        }
    }

    fn expect(&mut self, token: &Token, what: &str) -> Result<()> {
        if self.peek() == Some(token) {
            self.at += 1;
            Ok(())
        } else {
            Err(syntax(format!(
                "expected {what}, found {}",
                describe(self.peek())
            )))
        }
    }
}

/// `'7 days'`, `'12 hours'`, `'30 min'`, `'90 seconds'`, `'1 week'` in milliseconds.
pub fn parse_duration_ms(text: &str) -> Result<u64> {
    let invalid = || {
        SqlError::InvalidValue(format!(
            "duration {text:?}: write a positive whole number and a unit, such as '7 days', '12 hours', '30 minutes' or '90 seconds'"
        ))
    };
    let mut parts = text.split_whitespace();
    let (Some(number), Some(unit), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(invalid());
    };
    let n: u64 = number.parse().map_err(|_| invalid())?;
    let unit_ms: u64 = match unit.to_ascii_lowercase().trim_end_matches('s') {
        "week" => 7 * 86_400_000,
        "day" => 86_400_000,
        "hour" | "h" => 3_600_000,
        "minute" | "min" => 60_000,
        "second" | "sec" => 1_000,
        _ => return Err(invalid()),
    };
    match n.checked_mul(unit_ms) {
        Some(ms) if ms > 0 => Ok(ms),
        _ => Err(invalid()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(sql: &str) -> Result<RetentionStatement> {
        parse_retention_statement(sql).expect("a retention statement")
    }

    #[test]
    fn set_and_reset_parse() {
        assert_eq!(
            parse("ALTER TABLE Accounts SET (retain_epochs = 3, retain_for = '7 days');").unwrap(),
            RetentionStatement {
                table: "accounts".into(),
                epochs: Some(Some(3)),
                for_ms: Some(Some(7 * 86_400_000)),
                archive: None,
            }
        );
        assert_eq!(
            parse("alter table t reset (retain_for)").unwrap(),
            RetentionStatement {
                table: "t".into(),
                epochs: None,
                for_ms: Some(None),
                archive: None,
            }
        );
    }

    #[test]
    fn other_alter_table_forms_are_not_retention() {
        assert!(parse_retention_statement("ALTER TABLE t ADD COLUMN c INT").is_none());
        assert!(parse_retention_statement("ALTER TABLE t SET SCHEMA s").is_none());
        assert!(parse_retention_statement("SELECT 1").is_none());
    }

    #[test]
    fn bad_options_are_named() {
        let archived = parse("ALTER TABLE t SET (archive = true, retain_epochs = 2)").unwrap();
        assert_eq!(
            (archived.archive, archived.epochs),
            (Some(true), Some(Some(2)))
        );
        assert_eq!(
            parse("ALTER TABLE t RESET (archive)").unwrap().archive,
            Some(false)
        );
        assert!(parse("ALTER TABLE t SET (archive = 3)").is_err());
        assert!(parse("ALTER TABLE t SET (archive = true, archive = false)").is_err());
        let error = parse("ALTER TABLE t SET (retain_rows = 3)")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("retain_rows") && error.contains("retain_epochs"),
            "{error}"
        );
        let error = parse("ALTER TABLE t SET (retain_epochs = 0)")
            .unwrap_err()
            .to_string();
        assert!(error.contains("at least 1"), "{error}");
        let error = parse("ALTER TABLE t SET (retain_for = '3 fortnights')")
            .unwrap_err()
            .to_string();
        assert!(error.contains("3 fortnights"), "{error}");
        let error = parse("ALTER TABLE t SET (retain_epochs = 2, retain_epochs = 3)")
            .unwrap_err()
            .to_string();
        assert!(error.contains("twice"), "{error}");
        assert!(parse("ALTER TABLE t SET (retain_epochs 3)").is_err());
        assert!(parse("ALTER TABLE t SET (retain_epochs = 3) extra").is_err());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration_ms("1 week").unwrap(), 604_800_000);
        assert_eq!(parse_duration_ms("90 seconds").unwrap(), 90_000);
        assert_eq!(parse_duration_ms("2 hours").unwrap(), 7_200_000);
        assert!(parse_duration_ms("0 days").is_err());
        assert!(parse_duration_ms("days").is_err());
    }
}
