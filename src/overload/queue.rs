//! The requests waiting for a pool's permit: highest priority first, first come first
//! served within one, at most `max_queue` of them. A newcomer to a full queue takes the
//! place of the youngest waiter of the lowest priority below its own (that one is shed: it
//! has waited least, so shedding it wastes the least wait and keeps the order of those
//! that came before it); with none below its own, the newcomer itself is shed. Pure: no
//! clock, no lock (the pool's [`super::Overload`] holds it under its mutex).

use std::cmp::Reverse;
use std::collections::BTreeMap;

/// Where a waiter stands: its priority (higher first), then its arrival (lower first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place(Reverse<u32>, u64);

impl Place {
    pub fn priority(self) -> u32 {
        self.0 .0
    }
}

/// What became of a push.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed<T> {
    /// It waits at this place.
    Queued(Place),
    /// It waits at this place; the queue was full and this waiter, of lower priority,
    /// gave it its place.
    Evicted(Place, T, Place),
    /// The queue was full of waiters of its priority or higher: it is shed.
    Full(T),
}

/// The waiting items, bounded by `max`.
pub struct Queue<T> {
    waiting: BTreeMap<Place, T>,
    max: usize,
    arrivals: u64,
}

impl<T> Queue<T> {
    pub fn new(max: usize) -> Queue<T> {
        Queue {
            waiting: BTreeMap::new(),
            max,
            arrivals: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Queue `item` at `priority` (see the module's comment for a full queue).
    pub fn push(&mut self, priority: u32, item: T) -> Pushed<T> {
        self.arrivals += 1;
        let place = Place(Reverse(priority), self.arrivals);
        if self.waiting.len() < self.max {
            self.waiting.insert(place, item);
            return Pushed::Queued(place);
        }
        // The last place: the lowest priority, and within it the youngest.
        match self.waiting.last_key_value() {
            Some((&last, _)) if last.priority() < priority => {
                let Some(evicted) = self.waiting.remove(&last) else {
                    return Pushed::Full(item);
                };
                self.waiting.insert(place, item);
                Pushed::Evicted(place, evicted, last)
            }
            _ => Pushed::Full(item),
        }
    }

    /// The next to serve: the highest priority's oldest.
    pub fn pop(&mut self) -> Option<(Place, T)> {
        self.waiting.pop_first()
    }

    /// The next to serve among the priorities `fits` lets through: the highest such
    /// priority's oldest (each priority waiting is asked once, the queue's length aside).
    pub fn pop_first_where(&mut self, mut fits: impl FnMut(u32) -> bool) -> Option<(Place, T)> {
        let mut from = Place(Reverse(u32::MAX), 0);
        loop {
            let (&place, _) = self.waiting.range(from..).next()?;
            let p = place.priority();
            if fits(p) {
                return self.waiting.remove(&place).map(|item| (place, item));
            }
            // The first place of the next lower priority.
            from = Place(Reverse(p.checked_sub(1)?), 0);
        }
    }

    /// Whether anyone of `priority` or higher waits.
    pub fn waits_at_or_above(&self, priority: u32) -> bool {
        self.waiting
            .first_key_value()
            .is_some_and(|(place, _)| place.priority() >= priority)
    }

    /// Take `place` out (its waiter gave up or timed out); `None` if it is gone already.
    pub fn remove(&mut self, place: Place) -> Option<T> {
        self.waiting.remove(&place)
    }

    /// How many wait at `priority`.
    pub fn len_at(&self, priority: u32) -> usize {
        let from = Place(Reverse(priority), 0);
        let to = Place(Reverse(priority), u64::MAX);
        self.waiting.range(from..=to).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut Queue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop().map(|(_, x)| x)).collect()
    }

    #[test]
    fn the_highest_priority_goes_first_and_each_priority_in_arrival_order() {
        let mut q = Queue::new(10);
        for (p, x) in [
            (0, "f1"),
            (10, "p1"),
            (0, "f2"),
            (5, "m1"),
            (10, "p2"),
            (0, "f3"),
        ] {
            assert!(matches!(q.push(p, x), Pushed::Queued(_)));
        }
        assert_eq!(q.len_at(0), 3);
        assert_eq!(q.len_at(10), 2);
        assert_eq!(q.len_at(7), 0);
        assert_eq!(drain(&mut q), ["p1", "p2", "m1", "f1", "f2", "f3"]);
    }

    #[test]
    fn the_first_that_fits_is_the_oldest_of_the_highest_priority_let_through() {
        let mut q = Queue::new(10);
        for (p, x) in [(0, "f1"), (10, "p1"), (0, "f2"), (5, "m1"), (10, "p2")] {
            q.push(p, x);
        }
        let mut asked = Vec::new();
        let got = q.pop_first_where(|p| {
            asked.push(p);
            p == 0
        });
        assert_eq!(got.map(|(_, x)| x), Some("f1"));
        assert_eq!(asked, [10, 5, 0], "each priority asked once, highest first");
        assert_eq!(q.pop_first_where(|p| p > 10).map(|(_, x)| x), None);
        assert!(q.waits_at_or_above(10));
        assert!(!q.waits_at_or_above(11));
        assert_eq!(drain(&mut q), ["p1", "p2", "m1", "f2"]);
    }

    #[test]
    fn a_full_queue_sheds_its_lowest_priority_youngest_for_a_higher_newcomer() {
        let mut q = Queue::new(3);
        q.push(0, "f1");
        q.push(0, "f2");
        q.push(10, "p1");
        match q.push(10, "p2") {
            Pushed::Evicted(_, evicted, at) => {
                assert_eq!(evicted, "f2");
                assert_eq!(at.priority(), 0);
            }
            other => panic!("expected an eviction, got {other:?}"),
        }
        // No lower priority left below 10 but f1: p3 takes its place; then the queue holds
        // only priority 10 and a newcomer of 10 is itself shed, as is one of 0.
        assert!(matches!(q.push(10, "p3"), Pushed::Evicted(_, "f1", _)));
        assert_eq!(q.push(10, "p4"), Pushed::Full("p4"));
        assert_eq!(q.push(0, "f3"), Pushed::Full("f3"));
        assert_eq!(q.len(), 3);
        assert_eq!(drain(&mut q), ["p1", "p2", "p3"]);
    }

    #[test]
    fn an_equal_priority_newcomer_never_evicts() {
        let mut q = Queue::new(1);
        q.push(5, "a");
        assert_eq!(q.push(5, "b"), Pushed::Full("b"));
        assert_eq!(drain(&mut q), ["a"]);
    }

    #[test]
    fn a_removed_waiter_leaves_no_trace_and_a_second_removal_finds_nothing() {
        let mut q = Queue::new(4);
        let Pushed::Queued(a) = q.push(0, "a") else {
            panic!("queued")
        };
        q.push(0, "b");
        assert_eq!(q.remove(a), Some("a"));
        assert_eq!(q.remove(a), None);
        assert_eq!(q.len(), 1);
        assert_eq!(drain(&mut q), ["b"]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_queue_of_no_places_sheds_every_newcomer_of_priority_0() {
        let mut q: Queue<&str> = Queue::new(0);
        assert_eq!(q.push(0, "a"), Pushed::Full("a"));
        assert_eq!(q.push(9, "b"), Pushed::Full("b"));
    }
}
