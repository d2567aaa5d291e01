//! Tessera's own statements: the ones DataFusion's parser does not read, which change the
//! cluster's metadata rather than a table's rows (`CREATE USER`, `CREATE TAG`, ...). They
//! are recognized here from the tokens, before the SQL reaches DataFusion, by every front
//! end alike (the engine's `execute`, the PostgreSQL wire protocol, Flight SQL).

use crate::access::AccessStatement;
use crate::error::{Result, SqlError};
use crate::retention::RetentionStatement;
use crate::tags::TagStatement;
use crate::users::UserStatement;
use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
use datafusion::sql::sqlparser::keywords::Keyword;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};

/// One of Tessera's own statements.
#[derive(Debug, Clone, PartialEq)]
pub enum TesseraStatement {
    User(UserStatement),
    Tag(TagStatement),
    Retention(RetentionStatement),
    Access(AccessStatement),
}

impl TesseraStatement {
    /// The command tag PostgreSQL clients are answered with.
    pub fn tag(&self) -> &'static str {
        match self {
            TesseraStatement::User(user) => user.tag(),
            TesseraStatement::Tag(tag) => tag.command_tag(),
            TesseraStatement::Retention(retention) => retention.command_tag(),
            TesseraStatement::Access(access) => access.command_tag(),
        }
    }

    /// The statement as it may be shown (activity, logs): never with a password.
    pub fn redacted(&self) -> String {
        match self {
            TesseraStatement::User(user) => user.redacted(),
            TesseraStatement::Tag(tag) => tag.to_string(),
            TesseraStatement::Retention(retention) => retention.to_string(),
            TesseraStatement::Access(access) => access.to_string(),
        }
    }
}

/// `Some` if `sql` (the whole text: one statement, perhaps with a trailing `;`) is one of
/// Tessera's own statements, parsed or with the error that names what is wrong; `None`
/// for any other SQL.
pub fn parse_tessera_statement(sql: &str) -> Option<Result<TesseraStatement>> {
    if let Some(user) = crate::users::parse_user_statement(sql) {
        return Some(user.map(TesseraStatement::User));
    }
    if let Some(access) = crate::access::parse_access_statement(sql) {
        return Some(access.map(TesseraStatement::Access));
    }
    if let Some(retention) = crate::retention::parse_retention_statement(sql) {
        return Some(retention.map(TesseraStatement::Retention));
    }
    crate::tags::parse_tag_statement(sql).map(|tag| tag.map(TesseraStatement::Tag))
}

/// The statements of `sql`, split at the `;`s outside string literals, quoted names and
/// comments, each as written (without its `;`); empty ones dropped. Text that does not
/// tokenize is returned whole, for the parser to name its error.
pub fn split_statements(sql: &str) -> Vec<String> {
    let Ok(tokens) = Tokenizer::new(&PostgreSqlDialect {}, sql)
        .with_unescape(false)
        .tokenize()
    else {
        return vec![sql.to_string()];
    };
    let mut statements = Vec::new();
    let mut current = String::new();
    for token in tokens {
        if token == Token::SemiColon {
            statements.push(std::mem::take(&mut current));
        } else {
            current.push_str(&token.to_string());
        }
    }
    statements.push(current);
    statements.retain(|s| !is_blank(s));
    statements
}

/// Whether `sql` holds nothing but whitespace and comments.
fn is_blank(sql: &str) -> bool {
    Tokenizer::new(&PostgreSqlDialect {}, sql)
        .tokenize()
        .map(|tokens| tokens.iter().all(|t| matches!(t, Token::Whitespace(_))))
        .unwrap_or(false)
}

/// The significant tokens of a statement, read front to back.
pub(crate) struct Tokens {
    pub(crate) tokens: Vec<Token>,
    pub(crate) at: usize,
}

pub(crate) fn syntax(message: impl Into<String>) -> SqlError {
    SqlError::Syntax(message.into())
}

/// A token as an error message shows it.
pub(crate) fn describe(token: Option<&Token>) -> String {
    match token {
        None | Some(Token::EOF) => "the end of the statement".into(),
        Some(token) => format!("'{token}'"),
    }
}

impl Tokens {
    /// `sql`'s tokens without whitespace and comments, or `None` if it does not tokenize
    /// (then it is not one of these statements, and DataFusion names the error).
    pub(crate) fn of(sql: &str) -> Option<Tokens> {
        let tokens = Tokenizer::new(&PostgreSqlDialect {}, sql).tokenize().ok()?;
        Some(Tokens {
            tokens: tokens
                .into_iter()
                .filter(|t| !matches!(t, Token::Whitespace(_)))
                .collect(),
            at: 0,
        })
    }

    pub(crate) fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    /// Takes the next token if it is one of `keywords`, and says which.
    pub(crate) fn keyword_of(&mut self, keywords: &[Keyword]) -> Option<Keyword> {
        match self.peek() {
            Some(Token::Word(word)) if word.quote_style.is_none() => {
                let found = keywords.iter().copied().find(|k| *k == word.keyword)?;
                self.at += 1;
                Some(found)
            }
            _ => None,
        }
    }

    /// Takes the next token if it is the unquoted word `word` (one the parser has no
    /// keyword for, such as `TAG`).
    pub(crate) fn word(&mut self, word: &str) -> bool {
        match self.peek() {
            Some(Token::Word(w))
                if w.quote_style.is_none() && w.value.eq_ignore_ascii_case(word) =>
            {
                self.at += 1;
                true
            }
            _ => false,
        }
    }

    /// Takes `sequence` if the next tokens are exactly it.
    pub(crate) fn keywords(&mut self, sequence: &[Keyword]) -> bool {
        let start = self.at;
        for keyword in sequence {
            if self.keyword_of(&[*keyword]).is_none() {
                self.at = start;
                return false;
            }
        }
        true
    }

    /// A name (`what` says of what, for the error): folded to lower case unless quoted, as
    /// PostgreSQL does.
    pub(crate) fn name(&mut self, what: &str) -> Result<String> {
        match self.tokens.get(self.at) {
            Some(Token::Word(word)) => {
                self.at += 1;
                Ok(match word.quote_style {
                    Some(_) => word.value.clone(),
                    None => word.value.to_lowercase(),
                })
            }
            other => Err(syntax(format!(
                "expected {what}, found {}",
                describe(other)
            ))),
        }
    }

    /// A quoted string (`what` says of what, for the error).
    pub(crate) fn string(&mut self, what: &str) -> Result<String> {
        match self.tokens.get(self.at) {
            Some(Token::SingleQuotedString(text)) => {
                self.at += 1;
                Ok(text.clone())
            }
            other => Err(syntax(format!(
                "expected {what} as a quoted string, found {}",
                describe(other)
            ))),
        }
    }

    /// A whole number.
    pub(crate) fn number(&mut self, what: &str) -> Result<u64> {
        match self.tokens.get(self.at) {
            Some(Token::Number(n, _)) => {
                let value = n
                    .parse()
                    .map_err(|_| syntax(format!("expected {what}, found {n}")))?;
                self.at += 1;
                Ok(value)
            }
            other => Err(syntax(format!(
                "expected {what}, found {}",
                describe(other)
            ))),
        }
    }

    /// The end of the statement (a trailing `;` allowed); `what` names the statement.
    pub(crate) fn end(&mut self, what: &str) -> Result<()> {
        if self.peek() == Some(&Token::SemiColon) {
            self.at += 1;
        }
        match self.peek() {
            None | Some(Token::EOF) => Ok(()),
            other => Err(syntax(format!(
                "unexpected {} after the {what} statement (send it on its own)",
                describe(other)
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_at_semicolons_outside_literals_and_comments() {
        assert_eq!(
            split_statements("CREATE TAG a; SELECT ';' AS x -- a ; comment\n; ;\n"),
            vec!["CREATE TAG a", " SELECT ';' AS x -- a ; comment\n"]
        );
        assert_eq!(split_statements("SELECT 'it''s'"), vec!["SELECT 'it''s'"]);
        assert!(split_statements("  -- nothing\n").is_empty());
    }
}
