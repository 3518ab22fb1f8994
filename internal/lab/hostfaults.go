package lab

import (
	"context"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// slowHostDetachFactor is how much slower Longhorn's detach stage runs
// under --slow-host-detach: about 3 s becomes about 30 s, the "tens of
// seconds" a volume still held by another host node costs when the host's
// teardown drags.
const slowHostDetachFactor = 10

// ghostPod is the workloads-list entry --ghost-workload keeps: a pod long
// gone whose last phase stays listed, as Harvester issue 9761 reports.
// Succeeded, not Running: longhorn-manager v1.10.1 csi/node_server.go:172-175
// refuses NodePublish when no Pending pod is listed and not every listed pod
// is Running, so only a finished ghost refuses.
var ghostPod = simlonghorn.WorkloadStatus{PodName: "hp-volume-lab-ghost", PodStatus: "Succeeded"}

// FaultEvent is one host fault played, from its start to its end.
type FaultEvent struct {
	Fault  string    `json:"fault"`
	Target string    `json:"target"`
	Start  time.Time `json:"start"`
	End    time.Time `json:"end,omitzero"`
}

// Names of the host faults, in the log and the report.
const (
	faultLonghornFaulted = "longhorn-faulted"
	faultCordonHost      = "cordon-host"
	faultSlowHostDetach  = "slow-host-detach"
	faultGhostWorkload   = "ghost-workload"
)

// startHostFaults starts the host faults asked for; each needs the host
// storage path (Config.CheckHostFaults refused them without it).
func (r *run) startHostFaults(ctx context.Context, every func(time.Duration, func()), intn func(int) int) {
	c := &r.c
	lh := r.h.Longhorn
	if lh == nil {
		return
	}
	period := func(d, p time.Duration) time.Duration {
		if p > 0 {
			return p
		}
		return 4 * d
	}
	if d := c.LonghornFaulted; d > 0 {
		every(period(d, c.LonghornFaultedEvery), func() {
			vol := r.randomAttachedVolume(ctx, intn)
			if vol == "" {
				r.log.Info("fault: no attached Longhorn volume to fault, skipped", "fault", faultLonghornFaulted)
				return
			}
			r.hostFault(ctx, faultLonghornFaulted, vol, d,
				func(context.Context) error { lh.FaultVolumeUntil(vol, time.Now().Add(d)); return nil },
				func(context.Context) error { lh.FaultVolumeUntil(vol, time.Now()); return nil })
		})
	}
	if d := c.CordonHost; d > 0 {
		every(period(d, c.CordonHostEvery), func() {
			node := r.randomHostNode(ctx, intn)
			r.hostFault(ctx, faultCordonHost, node, d,
				func(ctx context.Context) error { return r.cordon(ctx, node, true) },
				func(ctx context.Context) error { return r.cordon(ctx, node, false) })
		})
	}
	if d := c.SlowHostDetach; d > 0 {
		every(period(d, c.SlowHostDetachEvery), func() {
			r.hostFault(ctx, faultSlowHostDetach, "every host node", d,
				func(context.Context) error { lh.SetSlowDetach(slowHostDetachFactor); return nil },
				func(context.Context) error { lh.SetSlowDetach(0); return nil })
		})
	}
	if d := c.GhostWorkload; d > 0 {
		every(period(d, c.GhostWorkloadEvery), func() {
			vol := r.randomAttachedVolume(ctx, intn)
			if vol == "" {
				r.log.Info("fault: no attached Longhorn volume for a ghost workload, skipped", "fault", faultGhostWorkload)
				return
			}
			r.hostFault(ctx, faultGhostWorkload, vol, d,
				func(context.Context) error { lh.SetGhostWorkload(vol, ghostPod); return nil },
				func(context.Context) error { lh.SetGhostWorkload(vol, simlonghorn.WorkloadStatus{}); return nil })
		})
	}
}

// hostFault plays one fault on target for d: on, then off once d has passed
// or the run ends. off runs in any case, on a context the run's end does
// not cancel: a host node left cordoned would keep the quiesce from ever
// finishing. Start and end go to the lab's log and to the report.
func (r *run) hostFault(ctx context.Context, fault, target string, d time.Duration, on, off func(context.Context) error) {
	if err := on(ctx); err != nil {
		r.log.Error(err, "fault: could not start", "fault", fault, "target", target)
		return
	}
	ev := FaultEvent{Fault: fault, Target: target, Start: time.Now()}
	r.log.Info("fault starts", "fault", fault, "target", target, "for", d)
	i := r.recordFault(ev)
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
	if err := off(context.WithoutCancel(ctx)); err != nil {
		r.log.Error(err, "fault: could not end", "fault", fault, "target", target)
		return
	}
	r.log.Info("fault ends", "fault", fault, "target", target, "after", time.Since(ev.Start).Round(time.Millisecond))
	r.mu.Lock()
	r.faults[i].End = time.Now()
	r.mu.Unlock()
}

func (r *run) recordFault(ev FaultEvent) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.faults = append(r.faults, ev)
	return len(r.faults) - 1
}

// randomAttachedVolume is a random Longhorn volume attached and healthy
// now ("" when none is).
func (r *run) randomAttachedVolume(ctx context.Context, intn func(int) int) string {
	vols, err := r.h.Longhorn.Volumes(ctx)
	if err != nil {
		r.log.Error(err, "fault: listing Longhorn volumes")
		return ""
	}
	var attached []string
	for _, v := range vols {
		if v.Status.State == simlonghorn.VolumeStateAttached && v.Status.Robustness == simlonghorn.VolumeRobustnessHealthy {
			attached = append(attached, v.Name)
		}
	}
	if len(attached) == 0 {
		return ""
	}
	return attached[intn(len(attached))]
}

// randomHostNode is the host node of a random guest VM, so that the
// fault meets a VM's next attachment pod; any host node when that VM has
// none yet.
func (r *run) randomHostNode(ctx context.Context, intn func(int) int) string {
	if n := r.h.HostNodeOf(ctx, r.nodes[intn(len(r.nodes))]); n != "" {
		return n
	}
	nodes := r.h.HostNodes()
	return nodes[intn(len(nodes))]
}

// cordon sets a host node's spec.unschedulable, as kubectl cordon does and
// Harvester's maintenance mode does first, before its VMs live-migrate away
// (that part is the migration fault's). A cordoned node keeps its running
// pods; a new attachment pod of a VM there stays Pending, as KubeVirt pins
// it to the launcher's node with the launcher's tolerations only (kubevirt
// v1.7.0 pkg/virt-controller/services/template.go), and the scheduler's
// NodeUnschedulable filter refuses a cordoned node to a pod that does not
// tolerate node.kubernetes.io/unschedulable.
func (r *run) cordon(ctx context.Context, node string, on bool) error {
	patch := fmt.Appendf(nil, `{"spec":{"unschedulable":%t}}`, on)
	_, err := r.h.Kube.CoreV1().Nodes().Patch(ctx, node, types.StrategicMergePatchType, patch, metav1.PatchOptions{})
	return err
}
