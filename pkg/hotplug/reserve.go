package hotplug

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// The queue's fence works inside one process: its informers, its unobserved
// writes and its pending intents. Two controller processes at once (an HA
// install whose leader handover overlaps, a rolling update) cannot see each
// other's, and the live read before a write does not see the other's write
// that is about to land. The reservation on the volume's host PVC closes
// that gap: an exclusive attach is written only under a fresh reservation
// of this process for its VM, taken with a resourceVersion precondition, so
// of two processes attaching one volume to two VMs exactly one gets it.

// reserveAction is what an exclusive attach must do about its volume's
// reservation before it may be written.
type reserveAction int

const (
	// reserveUse: the reservation is this process's, for this VM, and
	// fresh; write under it.
	reserveUse reserveAction = iota
	// reserveTake: there is none; take it.
	reserveTake
	// reserveRenew: this process's, for this VM, but no longer fresh.
	reserveRenew
	// reserveTakeOver: another's that expired: whoever wrote it has
	// finished every write it made under it.
	reserveTakeOver
	// reserveHeld: another VM holds the volume (the live read) or has a
	// reservation that has not expired; refuse the attach.
	reserveHeld
	// reserveWait: another process reserved the volume for this same VM;
	// wait until it expires (its write needs no fence from ours, but its
	// holder could release the reservation while our write is on its way).
	reserveWait
)

var reserveActionNames = [...]string{"use", "take", "renew", "take over", "held", "wait"}

func (a reserveAction) String() string { return reserveActionNames[a] }

// reserveVerdict is judgeReservation's answer; until is when a reservation
// that must be waited for, or refused, expires.
type reserveVerdict struct {
	action reserveAction
	until  time.Time
}

// judgeReservation decides, for an exclusive attach of a volume to vm by the
// process identity, what to do about the volume's reservation r, given the
// other VMs the live read shows holding the volume. It is a pure function.
//
// A reservation expires ReservationTTL after it was written: its holder
// writes only while it is younger than ReservationFresh (by the holder's
// check right before the write), and every write ends within RequestTimeout
// of that check, so after the TTL no write under it can still arrive.
func judgeReservation(now time.Time, cfg Config, vm, identity string, r Reservation, liveOthers []string) reserveVerdict {
	if len(liveOthers) > 0 {
		return reserveVerdict{action: reserveHeld}
	}
	if r.IsZero() {
		return reserveVerdict{action: reserveTake}
	}
	age := now.Sub(r.At)
	if r.VM == vm && r.Holder == identity {
		if age < cfg.ReservationFresh {
			return reserveVerdict{action: reserveUse}
		}
		return reserveVerdict{action: reserveRenew}
	}
	until := r.At.Add(cfg.ReservationTTL)
	switch {
	case !now.Before(until):
		return reserveVerdict{action: reserveTakeOver}
	case r.VM == vm:
		return reserveVerdict{action: reserveWait, until: until}
	default:
		return reserveVerdict{action: reserveHeld, until: until}
	}
}

// reservation is the outcome of reserve for one volume.
type reservation struct {
	verdict reserveVerdict
	// held refuses the attach (reserveHeld).
	held error
}

// maxReserveTries bounds how often one volume's reservation is read again
// after a conflict within one attempt; more means the PVC keeps changing,
// and the VM is retried with backoff.
const maxReserveTries = 3

// reserve makes sure each volume of vols (exclusive attaches about to be
// written to key) has a fresh reservation of this process for key's VM, or
// says why it cannot have one now. claims holds the PVCs as read and is
// updated with what was written. reread lists the volumes whose holders must
// be read again from the API server: their reservation was taken over from
// another VM, whose write may have landed after the live read began (it
// ended before the reservation expired, which for these was after
// liveAsked, the moment the live read was asked for; a reservation expired
// before then fenced no write the live read could miss).
func (q *Queue) reserve(ctx context.Context, key cache.ObjectName, vols []string, claims map[string]HostClaim, live map[string][]string, liveAsked time.Time) (out map[string]reservation, reread []string, err error) {
	out = map[string]reservation{}
	for _, vol := range vols {
		res, takenFromOther, err := q.reserveOne(ctx, key, vol, claims, live, liveAsked)
		if err != nil {
			return nil, nil, err
		}
		out[vol] = res
		if takenFromOther {
			reread = append(reread, vol)
		}
	}
	return out, reread, nil
}

func (q *Queue) reserveOne(ctx context.Context, key cache.ObjectName, vol string, claims map[string]HostClaim, live map[string][]string, liveAsked time.Time) (reservation, bool, error) {
	logger := klog.FromContext(ctx).WithValues("volume", vol)
	if cl, ok := claims[vol]; ok && cl.Cached {
		v := judgeReservation(q.now(), q.cfg, key.Name, q.cfg.Identity, cl.Reserved, othersThan(live[vol], key.Name))
		if !isBound(cl) || !v.action.writes() {
			// Only a write proves a cached claim current; what will
			// not be written is decided on a read. (A verdict only
			// moves towards writing as time passes, so one that
			// writes now still writes in the loop below.)
			fresh, err := q.readClaim(ctx, vol)
			if err != nil {
				return reservation{}, false, err
			}
			claims[vol] = fresh
		}
	}
	for try := 0; ; try++ {
		cl, ok := claims[vol]
		if !ok || !isBound(cl) {
			// confirmLocked refuses it as not ready; nothing to reserve.
			return reservation{verdict: reserveVerdict{action: reserveUse}}, false, nil
		}
		now := q.now()
		v := judgeReservation(now, q.cfg, key.Name, q.cfg.Identity, cl.Reserved, othersThan(live[vol], key.Name))
		switch v.action {
		case reserveUse:
			return reservation{verdict: v}, false, nil
		case reserveWait:
			logger.V(2).Info("volume reserved for this VM by another controller, waiting for the reservation to expire",
				"holder", cl.Reserved.Holder, "reservedAt", cl.Reserved.At, "until", v.until)
			return reservation{verdict: v}, false, nil
		case reserveHeld:
			held := &HeldError{Volume: vol, VM: cl.Reserved.VM,
				State: fmt.Sprintf("reserved for an attach (by controller %s at %s)", cl.Reserved.Holder, cl.Reserved.At.UTC().Format(time.RFC3339Nano))}
			if others := othersThan(live[vol], key.Name); len(others) > 0 {
				held = &HeldError{Volume: vol, VM: others[0], State: "attached or attaching (read from the API server)"}
			}
			return reservation{verdict: v, held: held}, false, nil
		}
		if try >= maxReserveTries {
			return reservation{}, false, fmt.Errorf("reserve volume %s for VM %s: its host PVC kept changing (%d conflicts)", vol, key.Name, try)
		}
		r := Reservation{VM: key.Name, Holder: q.cfg.Identity, At: now}
		rctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
		written, err := q.reader.Reserve(rctx, cl, r)
		cancel()
		switch {
		case err == nil:
			claims[vol] = written
			logger.V(2).Info("volume reserved", "action", v.action, "previous", cl.Reserved.VM, "previousHolder", cl.Reserved.Holder)
			reread := v.action == reserveTakeOver && cl.Reserved.VM != key.Name &&
				cl.Reserved.At.Add(q.cfg.ReservationTTL).After(liveAsked)
			return reservation{verdict: v}, reread, nil
		case apierrors.IsConflict(err):
			logger.V(2).Info("host PVC changed under the reservation, reading it again", "action", v.action)
		case apierrors.IsNotFound(err):
			claims[vol] = HostClaim{}
			continue
		default:
			return reservation{}, false, fmt.Errorf("reserve volume %s for VM %s: %w", vol, key.Name, err)
		}
		cl, err = q.readClaim(ctx, vol)
		if err != nil {
			return reservation{}, false, err
		}
		claims[vol] = cl
	}
}

// writes reports the verdicts that write a reservation.
func (a reserveAction) writes() bool {
	return a == reserveTake || a == reserveRenew || a == reserveTakeOver
}

func isBound(cl HostClaim) bool { return cl.Exists && cl.Phase == corev1.ClaimBound }

// readClaim reads a host PVC and its reservation from the API server.
func (q *Queue) readClaim(ctx context.Context, vol string) (HostClaim, error) {
	ctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
	defer cancel()
	cl, err := q.reader.Claim(ctx, vol)
	if err != nil {
		return HostClaim{}, fmt.Errorf("read host PVC %s: %w", vol, err)
	}
	return cl, nil
}

// SetClaimCache lets reservations be written and released from a watch
// cache of the host's PVCs instead of after a read of each (ClaimCache).
func (q *Queue) SetClaimCache(c ClaimCache) {
	q.mu.Lock()
	q.claimCache = c
	q.mu.Unlock()
}

// cachedClaim returns the claim as the claim cache holds it, if there is
// one and it can say.
func (q *Queue) cachedClaim(vol string) (HostClaim, bool) {
	q.mu.Lock()
	c := q.claimCache
	q.mu.Unlock()
	if c == nil {
		return HostClaim{}, false
	}
	return c.CachedClaim(vol)
}

// ownFresh reports whether cl carries a reservation of this process for vm
// young enough at now to write under it.
func (q *Queue) ownFresh(cl HostClaim, vm string, now time.Time) bool {
	r := cl.Reserved
	return !cl.Cached && r.VM == vm && r.Holder == q.cfg.Identity && now.Sub(r.At) < q.cfg.ReservationFresh
}

// ownLive reports whether cl carries a reservation of this process for vm
// that has not expired at now: the only kind worth releasing. An expired
// one fences nobody (every process takes it over, and takes it without
// reading the holders again once it expired before its live read), so
// removing it would cost a write and spare no one anything.
func (q *Queue) ownLive(cl HostClaim, vm string, now time.Time) bool {
	r := cl.Reserved
	return cl.Exists && r.VM == vm && r.Holder == q.cfg.Identity && now.Sub(r.At) < q.cfg.ReservationTTL
}

// unreserve removes this process's reservations of vols for key's VM: the
// VM's hold on them ended (a detach observed done, the VM gone) or the
// attach they were taken for was not written. known has PVCs as already
// read; others come from the claim cache (the removal's resourceVersion
// precondition catches a stale one) or are read now. A reservation that
// names another VM or process, or has expired, is left alone. A failure is
// logged and only makes the next VM wait for the reservation to expire.
func (q *Queue) unreserve(ctx context.Context, key cache.ObjectName, vols []string, known map[string]HostClaim) {
	for _, vol := range vols {
		logger := klog.FromContext(ctx).WithValues("volume", vol, "vm", key.String())
		cl, ok := known[vol]
		if !ok {
			cl, ok = q.cachedClaim(vol)
		}
		for try := 0; try <= maxReserveTries; try++ {
			if !ok {
				var err error
				if cl, err = q.readClaim(ctx, vol); err != nil {
					logger.Info("could not read the host PVC to release its reservation; it expires on its own", "err", err)
					break
				}
			}
			if !q.ownLive(cl, key.Name, q.now()) {
				break
			}
			rctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
			_, err := q.reader.Reserve(rctx, cl, Reservation{})
			cancel()
			if err == nil {
				logger.V(2).Info("volume reservation released")
				break
			}
			if apierrors.IsNotFound(err) {
				break
			}
			if !apierrors.IsConflict(err) {
				logger.Info("could not release the volume's reservation; it expires on its own", "err", err)
				break
			}
			ok = false // read it again
		}
	}
}

// releasesFirst takes out of p the resolutions that end the VM's hold on a
// volume (a detach observed done, an attach to a VM that is gone): their
// callers are answered only once this process's reservation is released, so
// a caller that moves the volume to another VM next, through this process
// or another one, does not find it still reserved.
func releasesFirst(p *plan) []resolution {
	var out, keep []resolution
	for _, r := range p.resolve {
		if (r.it.op == Detach && r.err == nil) || (r.it.op == Attach && r.err == ErrVMNotFound) {
			out = append(out, r)
		} else {
			keep = append(keep, r)
		}
	}
	p.resolve = keep
	return out
}

// releaseThenFinish releases this process's reservations of vols for key's
// VM (known: PVCs already read), then answers the callers of rs.
func (q *Queue) releaseThenFinish(ctx context.Context, key cache.ObjectName, vols []string, rs []resolution, known map[string]HostClaim) {
	if len(vols) == 0 && len(rs) == 0 {
		return
	}
	q.unreserve(ctx, key, vols, known)
	q.mu.Lock()
	defer q.mu.Unlock()
	now := q.now()
	if w := q.work[key]; w != nil {
		for _, r := range rs {
			q.resolveLocked(ctx, w, r, now)
		}
	}
	q.dropIfIdleLocked(key)
}

// releaseAsked releases the reservations a detach answered without an
// intent asked for, except of volumes the VM has business with again (an
// attach intent or a write on its way: those keep or renew it).
func (q *Queue) releaseAsked(ctx context.Context, key cache.ObjectName) {
	q.mu.Lock()
	w := q.work[key]
	if w == nil || len(w.release) == 0 {
		q.mu.Unlock()
		return
	}
	var vols []string
	for _, vol := range sortedKeys(w.release) {
		if w.intents[vol] == nil && !hasKey(w.expect, vol) {
			vols = append(vols, vol)
		}
	}
	answered := w.release
	w.release = map[string]chan struct{}{}
	q.dropIfIdleLocked(key)
	q.mu.Unlock()
	q.unreserve(ctx, key, vols, nil)
	for _, done := range answered {
		close(done)
	}
}

func volumesOf(rs []resolution) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.it.volume
	}
	return out
}

func othersThan(vms []string, vm string) []string {
	var out []string
	for _, v := range vms {
		if v != vm {
			out = append(out, v)
		}
	}
	return out
}
