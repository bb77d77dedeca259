//! The timezone whose midnight ends a daily or monthly budget window
//! (`budgets.reset_timezone`, default UTC).
//!
//! The filter runs in wasm32-wasip1 with no system tz database, so the
//! rules come compiled in: `jiff` with its bundled tzdb (IANA names), or a
//! POSIX TZ string (`<+0130>-1:30`, `CET-1CEST,M3.5.0,M10.5.0/3`). A local
//! day is whatever the zone says it is: 23 h on the spring changeover, 25 h
//! on the autumn one, and a midnight that falls in a gap starts the day at
//! the first instant after it. Times in answers (`reset_at`) stay UTC.
//!
//! [`Zone`] is `Copy` so that it can ride in every `Limit` (a bucket's
//! window carries its zone): a named zone is interned once per VM and
//! lives as long as the VM. The bound on what that keeps: one parsed zone
//! per distinct zone ever named by a loaded policy ([`MAX_ZONES`]).

use std::fmt;
use std::sync::Mutex;

use jiff::tz::TimeZone;
use jiff::Timestamp;
use serde::de::{self, Deserializer};
use serde::Deserialize;

const DAY_MS: u64 = 86_400_000;
/// Distinct zones one VM interns; past it a policy naming a new zone is
/// refused (a reload loop cannot grow memory without bound).
pub const MAX_ZONES: usize = 64;

/// UTC, or a zone from the bundled tzdb / a POSIX TZ string.
#[derive(Clone, Copy, Default)]
pub struct Zone(Option<&'static Named>);

pub struct Named {
    name: String,
    tz: TimeZone,
}

static INTERNED: Mutex<Vec<&'static Named>> = Mutex::new(Vec::new());

impl Zone {
    pub const UTC: Zone = Zone(None);

    /// An IANA name (`Europe/Rome`) or a POSIX TZ string; `UTC` is UTC.
    pub fn named(name: &str) -> Result<Zone, String> {
        let name = name.trim();
        if name.is_empty() || name.eq_ignore_ascii_case("utc") {
            return Ok(Zone::UTC);
        }
        let mut interned = INTERNED.lock().map_err(|_| "zone table poisoned")?;
        if let Some(found) = interned.iter().find(|n| n.name == name) {
            return Ok(Zone(Some(*found)));
        }
        let tz = TimeZone::get(name)
            .or_else(|_| TimeZone::posix(name))
            .map_err(|_| {
                format!(
                    "`{name}` is neither a timezone name (like `Europe/Rome`) \
                     nor a POSIX TZ string (like `CET-1CEST,M3.5.0,M10.5.0/3`)"
                )
            })?;
        if interned.len() >= MAX_ZONES {
            return Err(format!(
                "more than {MAX_ZONES} distinct timezones loaded in this VM; restart Envoy"
            ));
        }
        let named: &'static Named = Box::leak(Box::new(Named {
            name: name.to_string(),
            tz,
        }));
        interned.push(named);
        Ok(Zone(Some(named)))
    }

    pub fn name(&self) -> &str {
        self.0.map_or("UTC", |n| n.name.as_str())
    }

    /// Start of the local day holding `ms` (ms since the Unix epoch).
    pub fn day_start(self, ms: u64) -> u64 {
        let Some(n) = self.0 else {
            return ms / DAY_MS * DAY_MS;
        };
        local(&n.tz, ms, |z| z.start_of_day()).unwrap_or(ms / DAY_MS * DAY_MS)
    }

    /// Start of the local day after the one holding `ms`.
    pub fn next_day(self, ms: u64) -> u64 {
        let Some(n) = self.0 else {
            return (ms / DAY_MS * DAY_MS).saturating_add(DAY_MS);
        };
        local(&n.tz, ms, |z| {
            z.date()
                .tomorrow()?
                .to_zoned_datetime(z.time_zone().clone())
        })
        .unwrap_or((ms / DAY_MS * DAY_MS).saturating_add(DAY_MS))
    }

    /// Start of the local month holding `ms`.
    pub fn month_start(self, ms: u64) -> u64 {
        local(self.tz(), ms, |z| {
            z.date()
                .first_of_month()
                .to_zoned_datetime(z.time_zone().clone())
        })
        .unwrap_or(ms / DAY_MS * DAY_MS)
    }

    /// Start of the local month after the one holding `ms`.
    pub fn next_month(self, ms: u64) -> u64 {
        local(self.tz(), ms, |z| {
            z.date()
                .last_of_month()
                .tomorrow()?
                .to_zoned_datetime(z.time_zone().clone())
        })
        .unwrap_or((ms / DAY_MS * DAY_MS).saturating_add(DAY_MS))
    }

    fn tz(self) -> &'static TimeZone {
        static UTC: TimeZone = TimeZone::UTC;
        self.0.map_or(&UTC, |n| &n.tz)
    }
}

/// `f` of the local date-time of `ms` in `n`, back in ms since the epoch.
/// `None` only outside jiff's range (years ±9999): the caller falls back
/// to a plain day rather than fail a request.
fn local(
    tz: &TimeZone,
    ms: u64,
    f: impl FnOnce(&jiff::ZonedDateTime) -> Result<jiff::ZonedDateTime, jiff::Error>,
) -> Option<u64> {
    let ts = Timestamp::from_millisecond(i64::try_from(ms).ok()?).ok()?;
    let zdt = ts.to_zoned_datetime(tz.clone());
    let out = f(&zdt).ok()?.timestamp().as_millisecond();
    u64::try_from(out).ok()
}

impl PartialEq for Zone {
    fn eq(&self, other: &Zone) -> bool {
        self.name() == other.name()
    }
}
impl Eq for Zone {}

impl fmt::Debug for Zone {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `budgets:` in the policy: what all calendar budgets share.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetsConfig {
    /// Daily and monthly windows reset at this zone's midnight.
    #[serde(default, deserialize_with = "de_zone")]
    pub reset_timezone: Zone,
}

fn de_zone<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Zone, D::Error> {
    let text = String::deserialize(deserializer)?;
    Zone::named(&text).map_err(de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ms of a UTC civil time.
    fn utc(y: i16, mo: i8, d: i8, h: i8, mi: i8) -> u64 {
        jiff::civil::date(y, mo, d)
            .at(h, mi, 0, 0)
            .to_zoned_datetime(TimeZone::UTC)
            .unwrap()
            .timestamp()
            .as_millisecond() as u64
    }

    const H: u64 = 3_600_000;

    #[test]
    fn months_past_jiffs_range_fall_back_to_a_plain_day_without_a_panic() {
        let z = Zone::default();
        let far = u64::MAX - 5;
        assert_eq!(z.month_start(far), far / 86_400_000 * 86_400_000);
        assert!(z.next_month(far) >= z.month_start(far));
        assert_eq!(
            z.month_start(utc(2026, 12, 2, 15, 0)),
            utc(2026, 12, 1, 0, 0)
        );
        assert_eq!(
            z.next_month(utc(2026, 12, 31, 23, 59)),
            utc(2027, 1, 1, 0, 0)
        );
    }

    #[test]
    fn utc_is_the_default_and_days_are_24h() {
        let z = Zone::UTC;
        let noon = utc(2026, 3, 29, 12, 0);
        assert_eq!(z.day_start(noon), utc(2026, 3, 29, 0, 0));
        assert_eq!(z.next_day(noon), utc(2026, 3, 30, 0, 0));
        assert_eq!(z.month_start(noon), utc(2026, 3, 1, 0, 0));
        assert_eq!(Zone::named("UTC").unwrap(), Zone::UTC);
    }

    #[test]
    fn rome_on_a_normal_day_resets_at_local_midnight() {
        let rome = Zone::named("Europe/Rome").unwrap();
        // 2026-06-15 is CEST (UTC+2): local midnight is 22:00 UTC the day before.
        let t = utc(2026, 6, 15, 10, 0);
        assert_eq!(rome.day_start(t), utc(2026, 6, 14, 22, 0));
        assert_eq!(rome.next_day(t), utc(2026, 6, 15, 22, 0));
        // 23:30 local (21:30 UTC) is still the 15th; 00:30 local is the 16th.
        assert_eq!(
            rome.day_start(utc(2026, 6, 15, 21, 30)),
            utc(2026, 6, 14, 22, 0)
        );
        assert_eq!(
            rome.day_start(utc(2026, 6, 15, 22, 30)),
            utc(2026, 6, 15, 22, 0)
        );
        // Winter (CET, UTC+1).
        assert_eq!(
            rome.day_start(utc(2026, 1, 10, 5, 0)),
            utc(2026, 1, 9, 23, 0)
        );
    }

    #[test]
    fn rome_spring_changeover_day_is_23_hours() {
        let rome = Zone::named("Europe/Rome").unwrap();
        // 2026-03-29: 02:00 CET jumps to 03:00 CEST.
        let t = utc(2026, 3, 29, 12, 0);
        let start = rome.day_start(t);
        let end = rome.next_day(t);
        assert_eq!(start, utc(2026, 3, 28, 23, 0), "midnight CET");
        assert_eq!(end, utc(2026, 3, 29, 22, 0), "midnight CEST");
        assert_eq!(end - start, 23 * H);
        // The instant before the next midnight is still the 29th.
        assert_eq!(rome.day_start(end - 1), start);
        assert_eq!(rome.day_start(end), end);
    }

    #[test]
    fn rome_autumn_changeover_day_is_25_hours() {
        let rome = Zone::named("Europe/Rome").unwrap();
        // 2026-10-25: 03:00 CEST falls back to 02:00 CET.
        let t = utc(2026, 10, 25, 12, 0);
        let start = rome.day_start(t);
        let end = rome.next_day(t);
        assert_eq!(start, utc(2026, 10, 24, 22, 0), "midnight CEST");
        assert_eq!(end, utc(2026, 10, 25, 23, 0), "midnight CET");
        assert_eq!(end - start, 25 * H);
        // Both 02:30s (00:30 and 01:30 UTC) belong to the one day.
        assert_eq!(rome.day_start(utc(2026, 10, 25, 0, 30)), start);
        assert_eq!(rome.day_start(utc(2026, 10, 25, 1, 30)), start);
    }

    #[test]
    fn months_follow_the_local_calendar() {
        let rome = Zone::named("Europe/Rome").unwrap();
        // 2026-03-31 23:30 UTC is already April 1st in Rome (CEST).
        let t = utc(2026, 3, 31, 23, 30);
        assert_eq!(rome.month_start(t), utc(2026, 3, 31, 22, 0));
        assert_eq!(rome.next_month(t), utc(2026, 4, 30, 22, 0));
        // March in Rome spans the spring changeover: 31 days less an hour.
        let march = utc(2026, 3, 15, 0, 0);
        let len = rome.next_month(march) - rome.month_start(march);
        assert_eq!(len, 31 * 24 * H - H);
    }

    #[test]
    fn posix_strings_and_bad_names() {
        // A fixed offset of +1:30 (POSIX signs are inverted).
        let z = Zone::named("<+0130>-1:30").unwrap();
        let t = utc(2026, 6, 15, 10, 0);
        assert_eq!(z.day_start(t), utc(2026, 6, 14, 22, 30));
        let err = Zone::named("Mars/Olympus_Mons").unwrap_err();
        assert!(err.contains("Mars/Olympus_Mons"), "{err}");
        // Interned: the same name is the same zone.
        assert_eq!(
            Zone::named("Europe/Rome").unwrap(),
            Zone::named("Europe/Rome").unwrap()
        );
    }
}
