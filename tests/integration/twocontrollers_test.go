package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// holderMonitor reads the API server every few milliseconds, as
// fencingUnderLag's monitor does, and keeps every moment a volume was in two
// VMs (spec, legacy request list, VMI spec or VMI volume status) at once.
type holderMonitor struct {
	stop chan struct{}
	done chan struct{}
	mu   sync.Mutex
	seen []string
}

func (s *suite) monitorHolders(ctx context.Context, vols []string) *holderMonitor {
	m := &holderMonitor{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(m.done)
		for {
			select {
			case <-m.stop:
				return
			default:
			}
			for vol, holders := range s.liveHolders(ctx, vols) {
				if len(holders) > 1 {
					m.mu.Lock()
					if len(m.seen) < 20 {
						m.seen = append(m.seen, fmt.Sprintf("%s held by %v at once", vol, holders))
					}
					m.mu.Unlock()
				}
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	return m
}

// violations stops the monitor and returns what it saw.
func (m *holderMonitor) violations() []string {
	close(m.stop)
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.seen
}

// twoControllers runs two controller processes against one host namespace
// (each with its own clients, informers and queue, as two pods of an HA
// install whose leader handover overlaps, or a rolling update, would be).
// Round after round both get a publish of the same RWO volume at the same
// moment, each for a different VM: exactly one may succeed, the other must be
// refused with FailedPrecondition, and the monitor must never see the volume
// in both VMs. Unpublishing the winner must then let the other VM have it.
func (s *suite) twoControllers(t *testing.T) {
	vms := []string{"tc-a", "tc-b"}
	vol := s.scene(t, "tc", 1, vms...)[0]
	ctrls := []*framework.Controller{
		s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig()}),
		s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig()}),
	}
	attachers := []*attacher{}
	for _, c := range ctrls {
		attachers = append(attachers, newAttacher(func() csiClient { return c.Client }))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	mon := s.monitorHolders(ctx, []string{vol})

	const rounds = 8
	var doubles int
	for round := range rounds {
		// Alternate which controller asks for which VM.
		vmOf := func(i int) string { return vms[(i+round)%2] }
		start := make(chan struct{})
		errs := make([]error, len(ctrls))
		var wg sync.WaitGroup
		for i := range ctrls {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				errs[i] = attachers[i].publish(ctx, vmOf(i), vol)
			}()
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, err := range errs {
			switch status.Code(err) {
			case codes.OK:
				if winner >= 0 {
					doubles++
					t.Errorf("round %d: both publishes answered OK (%s and %s)", round, vmOf(winner), vmOf(i))
				}
				winner = i
			case codes.FailedPrecondition:
			default:
				t.Fatalf("round %d: publish to %s answered %v, want OK or FailedPrecondition", round, vmOf(i), err)
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: both publishes refused: %v", round, errs)
		}
		if doubles > 0 {
			// Clean up both before the next round.
			for i := range ctrls {
				if err := attachers[i].unpublish(ctx, vmOf(i), vol); err != nil {
					t.Fatalf("round %d: unpublish from %s: %v", round, vmOf(i), err)
				}
			}
			continue
		}
		loser := 1 - winner
		if err := attachers[winner].unpublish(ctx, vmOf(winner), vol); err != nil {
			t.Fatalf("round %d: unpublish from %s: %v", round, vmOf(winner), err)
		}
		// The other controller may now have it for its VM: the winner's
		// hold on the volume ended with the detach.
		if err := attachers[loser].publish(ctx, vmOf(loser), vol); err != nil {
			t.Fatalf("round %d: publish to %s after %s let go: %v", round, vmOf(loser), vmOf(winner), err)
		}
		if err := attachers[loser].unpublish(ctx, vmOf(loser), vol); err != nil {
			t.Fatalf("round %d: unpublish from %s: %v", round, vmOf(loser), err)
		}
	}
	for _, v := range mon.violations() {
		t.Error(v)
	}
	if doubles > 0 {
		t.Errorf("%d of %d rounds attached the volume to both VMs", doubles, rounds)
	}
}
