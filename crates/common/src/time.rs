//! Wall-clock times as Tessera records them: milliseconds since the Unix epoch, UTC.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch now, on this machine's clock.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `ms` as `YYYY-MM-DD HH:MM:SS.mmm UTC`.
pub fn format_ms(ms: u64) -> String {
    let (days, in_day) = (ms / 86_400_000, ms % 86_400_000);
    let (year, month, day) = civil_from_days(days as i64);
    let seconds = in_day / 1000;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{:03} UTC",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60,
        in_day % 1000
    )
}

/// The proleptic Gregorian date of a day number counted from 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_dates() {
        assert_eq!(format_ms(0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(format_ms(1_763_632_800_250), "2025-11-20 10:00:00.250 UTC");
        assert_eq!(format_ms(951_782_400_000), "2000-02-29 00:00:00.000 UTC");
        assert_eq!(format_ms(1_798_761_599_999), "2026-12-31 23:59:59.999 UTC");
    }
}
