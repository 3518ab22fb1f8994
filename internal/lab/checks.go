package lab

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/agent"
	"github.com/harvester-csi/harvester-csi-driver/internal/lab/invariants"
)

// checkLoop runs the continuous checkers.
func (r *run) checkLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	read := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		snap := r.mon.Snapshot()
		r.mu.Lock()
		r.inflight = append(r.inflight, InFlight{Seconds: now.Sub(r.start).Seconds(), Attaching: snap.Attaching, Detaching: snap.Detaching})
		r.mu.Unlock()
		r.violate(invariants.RWOHost(now, vmiVolumes(ctx, r.h, r.nodes))...)
		if st, err := staged(r.h, r.g.Nodes()); err == nil {
			r.violate(invariants.RWOStaged(now, st)...)
		}
		r.checkHostNodes(ctx, now)
		if evs, err := agent.ReadEvents(r.results); err == nil && len(evs) > read {
			r.violate(invariants.Data(dataChecks(evs[read:]))...)
			read = len(evs)
		}
		pending := r.mon.Pending()
		stuck := invariants.Stuck(now, r.c.StuckBound, pending)
		for i := range stuck {
			stuck[i].Details += r.stuckContext(ctx, stuck[i])
		}
		r.violate(stuck...)
		if err := r.g.Procs.Dead(); err != nil {
			r.violate(invariants.Violation{Kind: invariants.KindStuck, At: now, Details: "a lab component died: " + err.Error()})
		}
	}
}

// checkHostNodes checks that no Longhorn volume is attached on two host
// nodes (with host nodes only).
func (r *run) checkHostNodes(ctx context.Context, now time.Time) {
	if r.h.Longhorn == nil {
		return
	}
	vols, err := hostVolumes(ctx, r.h)
	if err != nil {
		r.log.V(2).Info("host volumes not read", "err", err)
		return
	}
	r.violate(invariants.RWOHostNodes(now, vols)...)
}

func dataChecks(evs []agent.Event) []invariants.DataCheck {
	out := make([]invariants.DataCheck, len(evs))
	for i, e := range evs {
		out[i] = invariants.DataCheck{At: e.Time, Role: e.Role, Volume: e.Volume, Pod: e.Namespace + "/" + e.Pod, Node: e.Node,
			OK: e.OK, Records: e.Records, Expected: e.Expected, Got: e.Got, Details: e.Detail}
	}
	return out
}

// stuckContext is what an operator would look at for a stuck volume: the
// VM spec and VMI volumeStatus entries of the volume, and the driver's log
// lines that name it.
func (r *run) stuckContext(ctx context.Context, v invariants.Violation) string {
	var b strings.Builder
	for _, n := range r.nodes {
		vm, vmi := r.h.VM(ctx, n)
		if vm != nil && vm.Spec.Template != nil {
			for _, vol := range vm.Spec.Template.Spec.Volumes {
				if strings.Contains(v.Volume, vol.Name) && vol.Name != "" {
					fmt.Fprintf(&b, "  VM %s spec lists %s\n", n, vol.Name)
				}
			}
			for _, req := range vm.Status.VolumeRequests {
				fmt.Fprintf(&b, "  VM %s volumeRequest %s\n", n, describeRequest(req))
			}
		}
		if vmi != nil {
			for _, vs := range vmi.Status.VolumeStatus {
				if strings.Contains(v.Volume, vs.Name) {
					fmt.Fprintf(&b, "  VMI %s volumeStatus %s phase=%s reason=%s message=%s\n", n, vs.Name, vs.Phase, vs.Reason, vs.Message)
				}
			}
		}
	}
	if v.Volume != "" {
		for _, l := range grepLog(r.g.Procs.LogPath("driver-controller"), firstVolume(v.Volume), 8) {
			b.WriteString("  driver: " + l + "\n")
		}
	}
	return b.String()
}

// describeRequest names a queued legacy request by what it asks for: its
// options are pointers, which %+v would print as addresses.
func describeRequest(r kubevirtv1.VirtualMachineVolumeRequest) string {
	switch {
	case r.AddVolumeOptions != nil:
		return "add " + r.AddVolumeOptions.Name
	case r.RemoveVolumeOptions != nil:
		return "remove " + r.RemoveVolumeOptions.Name
	}
	return "(empty)"
}

func firstVolume(s string) string {
	s = strings.Trim(s, "[]")
	if i := strings.IndexAny(s, " ,"); i > 0 {
		return s[:i]
	}
	return s
}

func grepLog(path, needle string, n int) []string {
	data, err := os.ReadFile(path)
	if err != nil || needle == "" {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, needle) {
			out = append(out, l)
		}
	}
	if len(out) > n {
		out = out[len(out)-n:]
	}
	return out
}

// finalChecks compares every view of the attachments after quiescing.
func (r *run) finalChecks(ctx context.Context) {
	backing, _ := filepath.EvalSymlinks(filepath.Join(r.c.Out, "host", "backing"))
	// The driver's sweeper and KubeVirt may still be settling: give the
	// views a bounded time to agree before reporting what differs.
	var last []invariants.Violation
	_ = wait.PollUntilContextTimeout(ctx, time.Second, max(time.Minute, r.c.scaled(2*time.Minute)), true, func(ctx context.Context) (bool, error) {
		f, err := finalState(ctx, r.g.Kube, r.h, r.g.Nodes(), backing)
		if err != nil {
			return false, nil
		}
		f.ExpectEmpty = true
		last = invariants.FinalAgreement(time.Now(), f)
		return len(last) == 0, nil
	})
	r.violate(last...)
	r.checkHostNodes(ctx, time.Now())
	if evs, err := agent.ReadEvents(r.results); err == nil {
		r.violate(invariants.Data(dataChecks(evs))...)
	}
}
