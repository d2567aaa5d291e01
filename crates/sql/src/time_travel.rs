//! `AS OF EPOCH n`: Tessera's time-travel clause, rewritten before DataFusion parses.
//!
//! `FROM t AS OF EPOCH 42 [alias]` becomes `FROM "t@42" AS t` (or the user's alias): the
//! catalog resolves `t@42` to table `t` read at epoch 42. The rewrite works on tokens, so
//! string literals and comments are never touched.

use crate::error::{Result, SqlError};
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::keywords::Keyword;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer, Word};

/// The separator between a table name and an epoch in catalog names.
pub const EPOCH_SEPARATOR: char = '@';

/// Splits a catalog name `t@42` into `("t", 42)`.
pub fn split_epoch_name(name: &str) -> Option<(&str, u64)> {
    let (table, epoch) = name.rsplit_once(EPOCH_SEPARATOR)?;
    Some((table, epoch.parse().ok()?))
}

fn is_word(token: &Token, text: &str) -> bool {
    matches!(token, Token::Word(w) if w.quote_style.is_none() && w.value.eq_ignore_ascii_case(text))
}

/// Rewrites every `AS OF EPOCH n` clause; SQL without one is returned unchanged.
pub fn rewrite_as_of_epoch(sql: &str) -> Result<String> {
    if !sql.to_ascii_uppercase().contains("EPOCH") {
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
            && at(2).is_some_and(|t| is_word(t, "EPOCH"));
        if !is_clause {
            // Copy this token and the whitespace after it.
            let end = significant.get(pos + 1).copied().unwrap_or(tokens.len());
            out.extend(tokens[i..end].iter().cloned());
            continue;
        }
        let epoch = match at(3) {
            Some(Token::Number(n, _)) => n.parse::<u64>().map_err(|_| {
                SqlError::Unsupported(format!("AS OF EPOCH needs a whole epoch number, got {n}"))
            })?,
            other => {
                return Err(SqlError::Unsupported(format!(
                    "AS OF EPOCH needs an epoch number, got {}",
                    other
                        .map(|t| t.to_string())
                        .unwrap_or_else(|| "end of statement".into())
                )))
            }
        };
        // The table name is the last word emitted (after trailing whitespace).
        while matches!(out.last(), Some(Token::Whitespace(_))) {
            out.pop();
        }
        let Some(Token::Word(table)) = out.pop() else {
            return Err(SqlError::Unsupported(
                "AS OF EPOCH must follow a table name".into(),
            ));
        };
        let plain_name = if table.quote_style.is_some() {
            table.value.clone()
        } else {
            table.value.to_lowercase()
        };
        out.push(Token::Word(Word {
            value: format!("{plain_name}{EPOCH_SEPARATOR}{epoch}"),
            quote_style: Some('"'),
            keyword: Keyword::NoKeyword,
        }));
        let has_alias = match at(4) {
            Some(Token::Word(w)) => w.keyword == Keyword::AS || w.keyword == Keyword::NoKeyword,
            _ => false,
        };
        if !has_alias {
            out.push(Token::Whitespace(
                datafusion::sql::sqlparser::tokenizer::Whitespace::Space,
            ));
            out.push(Token::Word(Word {
                value: "AS".into(),
                quote_style: None,
                keyword: Keyword::AS,
            }));
            out.push(Token::Whitespace(
                datafusion::sql::sqlparser::tokenizer::Whitespace::Space,
            ));
            out.push(Token::Word(Word {
                value: plain_name,
                quote_style: Some('"'),
                keyword: Keyword::NoKeyword,
            }));
        }
        out.push(Token::Whitespace(
            datafusion::sql::sqlparser::tokenizer::Whitespace::Space,
        ));
        skip_until = significant.get(pos + 4).copied().unwrap_or(tokens.len());
        rewritten = true;
    }
    if !rewritten {
        return Ok(sql.to_string());
    }
    Ok(out.iter().map(|t| t.to_string()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_the_clause_and_keeps_the_table_name_as_alias() {
        assert_eq!(
            rewrite_as_of_epoch("SELECT * FROM t AS OF EPOCH 3").unwrap(),
            r#"SELECT * FROM "t@3" AS "t" "#
        );
        assert_eq!(
            rewrite_as_of_epoch("select a from T as of epoch 12 x where x.a > 1").unwrap(),
            r#"select a from "t@12" x where x.a > 1"#
        );
        assert_eq!(
            rewrite_as_of_epoch(
                "select 1 from a as of epoch 1 as b join c as of epoch 2 on b.k = c.k"
            )
            .unwrap(),
            r#"select 1 from "a@1" as b join "c@2" AS "c" on b.k = c.k"#
        );
    }

    #[test]
    fn leaves_other_sql_alone() {
        let sql = "SELECT 'AS OF EPOCH 3' AS epoch FROM t";
        assert_eq!(rewrite_as_of_epoch(sql).unwrap(), sql);
    }

    #[test]
    fn keeps_escaped_quotes_in_a_rewritten_statement() {
        assert_eq!(
            rewrite_as_of_epoch("SELECT 'it''s' FROM t AS OF EPOCH 2").unwrap(),
            "SELECT 'it''s' FROM \"t@2\" AS \"t\" "
        );
    }

    #[test]
    fn names_bad_epochs() {
        assert!(rewrite_as_of_epoch("SELECT * FROM t AS OF EPOCH x")
            .unwrap_err()
            .to_string()
            .contains("epoch number"));
        assert!(rewrite_as_of_epoch("SELECT * FROM t AS OF EPOCH -1").is_err());
        assert_eq!(split_epoch_name("orders@7"), Some(("orders", 7)));
        assert_eq!(split_epoch_name("orders"), None);
    }
}
