package hotplug

// A live migration's window before its hand-off: KubeVirt shows it on the
// VMI only as a second virt-launcher pod in status.activePods.

import (
	"context"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// migrationUnderWay says, for the log and the caller's answer, between
// which host nodes the VM's VMI is in a live migration that has not reached
// its hand-off yet, or "" when it is not.
//
// A hot-plug written while a migration is under way is not carried out
// until it ends, and before the hand-off it is worse: virt-controller
// gives the new set an attachment pod on the source node and builds the
// target's attachment pod from the VMI's hot-plug volumes too, once the
// target's virt-launcher pod is ready (kubevirt v1.7.0
// pkg/virt-controller/watch/migration/migration.go:1642-1651, 1383-1389), so a
// Longhorn volume that is not attached anywhere yet gets attachment tickets
// on two host nodes at once, and Longhorn attaches a migratable volume in
// that state on neither ("Volume migration between ... failed; detach
// volume from extra node to resume", longhorn-manager v1.10.1
// controller/volume_attachment_controller.go:692-703). The target's
// attachment pod never runs, the migration never reaches its hand-off, and
// the VM's hot-plugs wait with it until someone cancels the migration.
//
// The VMI shows the migration in status.migrationState only from the
// hand-off on; before that, from the moment the target's virt-launcher pod
// exists, only as a second pod in status.activePods, which names every pod
// the VMI controls, those that ended included (a migrated VMI keeps its
// source's). So when the VMI names more than one pod not known to have
// ended, the pods that may still run are read from the API server, and
// those that ended are remembered.
func (q *Queue) migrationUnderWay(ctx context.Context, key cache.ObjectName, o observed) string {
	vmi := o.vmi
	if vmi == nil {
		q.mu.Lock()
		delete(q.launchersEnded, key) // a new VMI has pods of its own
		q.mu.Unlock()
		return ""
	}
	if vmi.Status.Phase != kubevirtv1.Running {
		return ""
	}
	if o.migration() != nil {
		// From the hand-off on the target's pods run and a write no
		// longer reaches them: legacy KubeVirt refuses it until the end
		// (retried), declarative carries it out after.
		return ""
	}
	q.mu.Lock()
	ended := q.launchersEnded[key]
	var maybe []types.UID
	for uid := range vmi.Status.ActivePods {
		if !ended[uid] {
			maybe = append(maybe, uid)
		}
	}
	q.mu.Unlock()
	if len(maybe) < 2 {
		return ""
	}
	rctx, cancel := context.WithTimeout(ctx, q.cfg.RequestTimeout)
	live, err := q.reader.LiveLaunchers(rctx, key.Name, vmi.UID)
	cancel()
	if err != nil {
		// Without the read, the queue writes as it did before it had one.
		klog.FromContext(ctx).V(2).Info("cannot tell whether the VM migrates: reading its virt-launcher pods failed", "err", err)
		return ""
	}
	var nodes []string
	q.mu.Lock()
	if q.launchersEnded[key] == nil {
		q.launchersEnded[key] = map[types.UID]bool{}
	}
	for uid := range q.launchersEnded[key] {
		if _, listed := vmi.Status.ActivePods[uid]; !listed {
			delete(q.launchersEnded[key], uid) // gone from the VMI's list too
		}
	}
	for _, uid := range maybe {
		if !live[uid] {
			q.launchersEnded[key][uid] = true
			continue
		}
		node := vmi.Status.ActivePods[uid]
		if node == "" {
			node = "(not scheduled yet)"
		}
		nodes = append(nodes, node)
	}
	q.mu.Unlock()
	if len(nodes) < 2 {
		return ""
	}
	slices.Sort(nodes)
	return "with virt-launcher pods on host nodes " + strings.Join(nodes, " and ")
}
