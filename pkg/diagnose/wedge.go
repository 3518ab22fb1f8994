package diagnose

import (
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// WedgedVM: the driver's queue reports an intent wedged in KubeVirt (it
// waits on a KubeVirt step of a running VMI that has shown no progress for
// the controller's --wedged-after); the detail names what the host objects
// show as the likely cause, each matching a section of
// docs/troubleshooting.md ("A VM wedged in KubeVirt").
const WedgedVM = "vm-wedged"

// Causes of a wedge that the host objects show, in the words the findings
// use; docs/troubleshooting.md has a way out for each.
const (
	causePodPending   = "attachment pod Pending"
	causePodGone      = "attachment pod gone"
	causeRemovalStuck = "removed volume still in the VMI"
	causeVMWrites     = "KubeVirt's writes of the VM fail"
	causeUnknown      = "no cause visible in the VM, VMI or attachment pods"
)

// judgeWedges turns each wedged intent of the queue into a finding, with
// the causes the VM, its VMI and its attachment pods show.
func (v *view) judgeWedges(r *report) {
	for _, st := range v.in.Queue {
		for _, it := range st.Intents {
			if it.Wedged == nil {
				continue
			}
			causes := v.wedgeCauses(st.VM, it.Volume, it.Wedged)
			r.add(Finding{Kind: WedgedVM, Volume: it.Volume, VM: st.VM, Detail: fmt.Sprintf("%s wedged in KubeVirt (%s) for %s: %s; likely cause: %s",
				it.Op, it.Wedged.Reason, v.in.Now.Sub(it.Wedged.Since).Round(time.Second), it.Wedged.Describe(), strings.Join(causes, "; "))})
		}
	}
}

// wedgeCauses reads the host objects for what holds the VM: an attachment
// pod that does not start (KubeVirt creates no other while one is Pending,
// kubevirt v1.7.0 pkg/virt-controller/watch/volume-hotplug.go), the
// volume's attachment pod gone while the VMI still names it, removed
// volumes the VMI still lists (virt-handler keeps mounting them and
// virt-controller keeps their attachment pod, kubevirt PR 18044; an add
// listed after one waits for it, kubevirt issue 16520), and the VM's
// Failure condition (KubeVirt's own writes of the VM refused).
func (v *view) wedgeCauses(vm, vol string, w *hotplug.Wedge) []string {
	var causes []string
	pods := v.attachmentPodsOf(vm)
	for _, p := range pods {
		if p.Status.Phase == corev1.PodPending && p.DeletionTimestamp == nil {
			causes = append(causes, fmt.Sprintf("%s: %s for %s (%s)", causePodPending, p.Name, v.age(p.CreationTimestamp), pendingReason(p)))
		}
	}
	if w.AttachmentPod != "" && v.in.HostPodsRead && !slices.ContainsFunc(pods, func(p *corev1.Pod) bool { return p.Name == w.AttachmentPod }) {
		causes = append(causes, fmt.Sprintf("%s: the VMI names %s for the volume, the host has no such pod", causePodGone, w.AttachmentPod))
	}
	if removed := v.removedInVMI(vm); len(removed) > 0 {
		causes = append(causes, fmt.Sprintf("%s: %s", causeRemovalStuck, strings.Join(removed, ", ")))
	}
	for i := range v.in.VMs {
		if vmObj := &v.in.VMs[i]; vmObj.Name == vm {
			if msg := failure(vmObj); msg != "" {
				causes = append(causes, fmt.Sprintf("%s: %s", causeVMWrites, msg))
			}
		}
	}
	if len(causes) == 0 {
		causes = append(causes, causeUnknown+" (virt-handler on the VM's host node)")
	}
	return causes
}

// attachmentPodsOf lists the VM's attachment pods, sorted by name.
func (v *view) attachmentPodsOf(vm string) []*corev1.Pod {
	launchers := map[string]*corev1.Pod{}
	for i := range v.in.HostPods {
		if p := &v.in.HostPods[i]; p.Labels[kubevirtAppLabel] == launcherPodApp {
			launchers[p.Name] = p
		}
	}
	var out []*corev1.Pod
	for i := range v.in.HostPods {
		p := &v.in.HostPods[i]
		if p.Labels[kubevirtAppLabel] == attachmentPodApp && attachmentPodVM(p, launchers) == vm {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// removedInVMI lists the hotplug entries of the VM's VMI status whose
// volume has left the VMI spec, with their phase and attachment pod.
func (v *view) removedInVMI(vm string) []string {
	vmi := v.vmis[vm]
	if vmi == nil {
		return nil
	}
	inSpec := map[string]bool{}
	for _, vol := range vmi.Spec.Volumes {
		inSpec[vol.Name] = true
	}
	var out []string
	for _, s := range vmi.Status.VolumeStatus {
		if s.HotplugVolume == nil || inSpec[s.Name] {
			continue
		}
		out = append(out, removedEntry(s))
	}
	return out
}

func removedEntry(s kubevirtv1.VolumeStatus) string {
	if pod := s.HotplugVolume.AttachPodName; pod != "" {
		return fmt.Sprintf("%s (%s, attachment pod %s)", s.Name, s.Phase, pod)
	}
	return fmt.Sprintf("%s (%s)", s.Name, s.Phase)
}
