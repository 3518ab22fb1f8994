package hotplug

// Writing a VM's changes: the fresh reads before an exclusive attach (who
// holds the volume, its host PVC and reservation), then the attempts at the
// backend, each confirmed first (confirm.go) and booked after (record.go).

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// write makes the changes, retrying conflicts at once after a fresh read (the
// backend reads anew on every call) a bounded number of times. Before an
// exclusive attach goes out, who holds its volume is read from the API
// server itself, and the volume is reserved for the VM on its host PVC: an
// informer that lags, or a write of another process (a controller that has
// not noticed it lost its lease, a second replica during a rolling update),
// must never let one volume be attached to two VMs. joins says the changes
// join the VM's cycle under way (joinable) rather than begin one; withdraws
// that they are removals of adds whose attach intents stay
// (withdrawFromMigration).
func (q *Queue) write(ctx context.Context, key cache.ObjectName, changes []Change, joins, withdraws bool) error {
	logger := klog.FromContext(ctx)
	var live map[string][]string
	excl := q.exclusiveAdds(key, changes)
	liveAsked := q.now()
	if len(excl) > 0 {
		h, err := q.liveHolders(ctx, excl)
		if err != nil {
			return q.noteFailure(ctx, key, fmt.Errorf("read who holds %v: %w", excl, err))
		}
		live = h
	}
	claims, err := q.readClaims(ctx, changes, excl)
	if err != nil {
		return q.noteFailure(ctx, key, err)
	}
	pending := changes
	for attempt := 0; ; attempt++ {
		reserved, err := q.reserveAndReread(ctx, key, excl, pending, claims, live, liveAsked)
		if err != nil {
			return q.noteFailure(ctx, key, err)
		}
		// now bounds this attempt: every exclusive attach in it was
		// checked fresh at now, and the backend call ends RequestTimeout
		// after it, so no write outlives its reservation's TTL.
		now := q.now()
		q.mu.Lock()
		var unwritten []string
		pending, unwritten = q.confirmLocked(ctx, key, pending, live, claims, reserved, now, withdraws)
		until := q.untilLocked(key, pending)
		q.mu.Unlock()
		if len(pending) == 0 {
			q.unreserve(ctx, key, unwritten, claims)
			return nil
		}
		q.metrics.batchSize.Observe(float64(len(pending)))
		logger.V(2).Info("applying hotplug changes", "backend", q.backend.Name(), "changes", fmtChanges(pending), "attempt", attempt)
		start := q.now()
		actx, cancel := q.attemptContext(ctx, now, until)
		outs := q.backend.Apply(actx, key.Name, pending)
		cancel()
		q.metrics.applyDuration.Observe(q.now().Sub(start).Seconds())
		if len(outs) != len(pending) {
			return fmt.Errorf("backend %s answered %d outcomes for %d changes", q.backend.Name(), len(outs), len(pending))
		}
		retry, turnedDown, answers, failed := q.record(ctx, key, pending, outs, joins)
		// Releases wait until the call is made: they must not eat into
		// its deadline, which runs from now.
		q.releaseThenFinish(ctx, key, append(turnedDown, unwritten...), answers, claims)
		if failed != nil {
			return q.noteFailure(ctx, key, failed)
		}
		if len(retry) == 0 {
			q.wq.AddAfter(key, q.cfg.MaxHold) // in case no informer event ever shows the result
			return nil
		}
		if attempt+1 >= q.cfg.MaxConflictRetries {
			return fmt.Errorf("%d hotplug changes still conflicting after %d attempts", len(retry), attempt+1)
		}
		// Spread concurrent writers apart before reading again.
		delay := time.Duration(10<<attempt)*time.Millisecond + time.Duration(rand.Int64N(int64(10*time.Millisecond)))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		pending = retry
	}
}

// reserveAndReread reserves the volumes of the exclusive attaches among
// pending (see reserve), and reads again from the API server who holds
// those whose reservation was taken over from another VM, into live.
func (q *Queue) reserveAndReread(ctx context.Context, key cache.ObjectName, excl []string, pending []Change, claims map[string]HostClaim, live map[string][]string, liveAsked time.Time) (map[string]reservation, error) {
	var vols []string
	for _, c := range pending {
		if c.Op == Attach && slices.Contains(excl, c.Volume) {
			vols = append(vols, c.Volume)
		}
	}
	if len(vols) == 0 {
		return nil, nil
	}
	reserved, reread, err := q.reserve(ctx, key, vols, claims, live, liveAsked)
	if err != nil {
		return nil, err
	}
	if len(reread) > 0 {
		h, err := q.liveHolders(ctx, reread)
		if err != nil {
			q.unreserve(ctx, key, reread, claims)
			return nil, fmt.Errorf("read who holds %v: %w", reread, err)
		}
		for _, vol := range reread {
			live[vol] = h[vol]
		}
	}
	return reserved, nil
}

// exclusiveAdds lists the volumes of changes that exclusive attach intents
// of the VM are about to add.
func (q *Queue) exclusiveAdds(key cache.ObjectName, changes []Change) []string {
	q.mu.Lock()
	defer q.mu.Unlock()
	w := q.work[key]
	if w == nil {
		return nil
	}
	var vols []string
	for _, c := range changes {
		if it := w.intents[c.Volume]; c.Op == Attach && it != nil && it.op == Attach && it.exclusive {
			vols = append(vols, c.Volume)
		}
	}
	return vols
}

// readClaims reads, from the API server, the host PVC (and its
// reservation) of every volume changes add. For the exclusive attaches
// among them (excl) the claim cache's copy stands in for the read: each
// is reserved next, and the reservation's write, made with the cached
// resourceVersion, is the claim check (reserveOne reads whatever it does
// not write).
func (q *Queue) readClaims(ctx context.Context, changes []Change, excl []string) (map[string]HostClaim, error) {
	ctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
	defer cancel()
	out := map[string]HostClaim{}
	for _, c := range changes {
		if c.Op != Attach {
			continue
		}
		if slices.Contains(excl, c.Volume) {
			if cl, ok := q.cachedClaim(c.Volume); ok {
				out[c.Volume] = cl
				continue
			}
		}
		cl, err := q.reader.Claim(ctx, c.Volume)
		if err != nil {
			return nil, fmt.Errorf("read host PVC %s: %w", c.Volume, err)
		}
		out[c.Volume] = cl
	}
	return out, nil
}

// liveHolders reads from the API server which VMs hold each volume: in the
// VM spec, a queued legacy request, the VMI spec or its volume status.
// Workers asking at the same time share one read (liveReads).
func (q *Queue) liveHolders(ctx context.Context, vols []string) (map[string][]string, error) {
	r, err := q.live.get(ctx)
	if err != nil {
		return nil, err
	}
	vms, vmis := r.vms, r.vmis
	want := map[string]bool{}
	for _, v := range vols {
		want[v] = true
	}
	out := map[string][]string{}
	add := func(claims []string, vm string) {
		for _, c := range claims {
			if want[c] && !slices.Contains(out[c], vm) {
				out[c] = append(out[c], vm)
			}
		}
	}
	for i := range vms {
		add(vmClaims(&vms[i]), vms[i].Name)
	}
	for i := range vmis {
		add(vmiClaims(&vmis[i]), vmis[i].Name)
	}
	return out, nil
}

func fmtChanges(cs []Change) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.Op.String() + ":" + c.Volume
	}
	return out
}
