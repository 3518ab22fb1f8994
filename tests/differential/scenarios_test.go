package differential

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// scenario is a sequence of writes and waits on a VM of its own with vols
// host PVCs of its own (named <name>-00, -01, ...).
type scenario struct {
	name string
	vols int
	run  func(r *run)
	// legacyRace: in the legacy mode the driver's writer makes its two
	// changes as two addvolume/removevolume calls, and whether
	// virt-controller's pass falls between them is timing, on KubeVirt as
	// on the simulator; only the settled state and the answers are
	// compared there.
	legacyRace bool
}

var scenarios = []scenario{
	{"add", 1, func(r *run) {
		r.apply("add", attach(r.vol(0)))
		r.settle(r.vol(0))
	}, false},
	{"remove", 1, func(r *run) {
		r.apply("add", attach(r.vol(0)))
		r.settle(r.vol(0))
		r.apply("remove", detach(r.vol(0)))
		r.settle()
	}, false},
	{"add-two", 2, func(r *run) {
		r.apply("add both", attach(r.vol(0)), attach(r.vol(1)))
		r.settle(r.vol(0), r.vol(1))
	}, true},
	{"swap", 2, func(r *run) {
		r.apply("add", attach(r.vol(0)))
		r.settle(r.vol(0))
		r.apply("remove one, add the other", detach(r.vol(0)), attach(r.vol(1)))
		r.settle(r.vol(1))
	}, true},
	// The add comes once the volume left the VMI's spec, while its entry
	// is still in the VMI's status (its unmount held, see hold).
	{"readd", 1, func(r *run) {
		r.apply("add", attach(r.vol(0)))
		r.settle(r.vol(0))
		mounted := unmountHold(r.s.kv, r.s.handler, r.s.h.Namespace, r.vm)
		r.do("hold unmounts", func(ctx context.Context) error { return mounted.on(ctx, r.s.h.Kube) })
		r.apply("remove", detach(r.vol(0)))
		// The legacy controller takes the volume off the VMI before it
		// takes it off the VM: wait for both.
		r.until("the volume off the VM and the VMI spec", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, _ []*corev1.Pod) bool {
			return vm != nil && vm.Spec.Template != nil && len(hotplugNames(vm.Spec.Template.Spec.Volumes)) == 0 && len(vm.Status.VolumeRequests) == 0 &&
				vmi != nil && len(hotplugNames(vmi.Spec.Volumes)) == 0
		})
		r.apply("add again", attach(r.vol(0)))
		// The legacy controller puts the volume back on the VMI while the
		// old entry is still there: let go only once it has, since a
		// virt-handler pass before that would unmount it, and which comes
		// first is timing. The declarative one waits for the entry to go
		// (on KubeVirt as on the simulator), so there the hold must go first.
		if r.s.legacy {
			r.until("the volume back in the VMI spec", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, _ []*corev1.Pod) bool {
				return vmi != nil && slices.Contains(hotplugNames(vmi.Spec.Volumes), r.vol(0))
			})
		}
		r.do("let unmounts through", func(ctx context.Context) error { return mounted.off(ctx, r.s.h.Kube) })
		r.settle(r.vol(0))
	}, false},
	// KubeVirt's own answers to an add of what is there and a removal of
	// what is not, through virt-api's VM subresources in either mode.
	{"already", 2, func(r *run) {
		r.apply("add", attach(r.vol(0)))
		r.settle(r.vol(0))
		r.addVolume("addvolume present", r.vol(0))
		r.removeVolume("removevolume absent", r.vol(1))
		r.settle(r.vol(0))
	}, false},
	{"stop-start", 2, func(r *run) {
		r.apply("add both", attach(r.vol(0)), attach(r.vol(1)))
		r.settle(r.vol(0), r.vol(1))
		r.do("stop VM", func(ctx context.Context) error { return r.s.h.StopVM(ctx, r.vm) })
		r.do("start VM", func(ctx context.Context) error { return r.s.h.StartVM(ctx, r.vm) })
		r.settle(r.vol(0), r.vol(1))
	}, true},
	// The attachment pod is held starting (see hold) while the volume
	// leaves the VM, then let go.
	{"remove-while-starting", 1, func(r *run) {
		pods := podStartHold(r.s.h.Kube, r.s.h.Namespace)
		r.do("hold pods starting", func(ctx context.Context) error { return pods.on(ctx, r.s.h.Kube) })
		r.apply("add", attach(r.vol(0)))
		r.until("an attachment pod starting", func(_ *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance, pods []*corev1.Pod) bool {
			return slices.ContainsFunc(pods, func(p *corev1.Pod) bool { return p.DeletionTimestamp == nil })
		})
		r.apply("remove", detach(r.vol(0)))
		// The legacy removal request has been seen to vanish from the VM's
		// status here, on KubeVirt v1.7.0 as the only writer it raced is
		// virt-controller: the driver's queue, judging by the VM, writes
		// again, and so does the scenario (unrecorded, noted).
		r.until("the volume off the VMI spec", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, _ []*corev1.Pod) bool {
			if r.s.legacy && vm != nil && vm.Spec.Template != nil && len(hotplugNames(vm.Spec.Template.Spec.Volumes)) > 0 && len(vm.Status.VolumeRequests) == 0 {
				r.rec.note("removal request not seen in the VM: written again")
				r.s.w.Apply(r.ctx, r.vm, []hotplug.Change{detach(r.vol(0))})
			}
			return vmi != nil && len(hotplugNames(vmi.Spec.Volumes)) == 0
		})
		r.do("let pods start", func(ctx context.Context) error { return pods.off(ctx, r.s.h.Kube) })
		r.settle()
	}, false},
}

func attach(vol string) hotplug.Change { return hotplug.Change{Volume: vol, Op: hotplug.Attach} }
func detach(vol string) hotplug.Change { return hotplug.Change{Volume: vol, Op: hotplug.Detach} }

// run is one scenario on one control plane. Its steps stop at the first
// error, which runScenario returns.
type run struct {
	ctx  context.Context
	s    *side
	rec  *recorder
	vm   string
	vols []string
	err  error
}

func runScenario(ctx context.Context, s *side, sc scenario, attempt int) (trace, error) {
	name := sc.name
	if attempt > 0 {
		name = fmt.Sprintf("%s-r%d", sc.name, attempt) // a fresh VM and fresh volumes
	}
	r := &run{ctx: ctx, s: s, vm: "vm-" + name}
	if err := s.h.CreateVMs(ctx, r.vm); err != nil {
		return trace{}, err
	}
	vols, err := s.h.CreateVolumes(ctx, name, sc.vols)
	if err != nil {
		return trace{}, err
	}
	r.vols = vols
	r.rec = &recorder{vm: r.vm, vols: vols}
	// Recording starts from the running VM, once the observer's watch has
	// caught up with what CreateVMs saw.
	if err := testwait.Poll(ctx, "the observer sees the VMI running", func() (bool, string, error) {
		_, vmi, _ := s.obs.objects(r.rec)
		return vmi != nil && vmi.Status.Phase == kubevirtv1.Running, vmiState(vmi), nil
	}); err != nil {
		return trace{}, err
	}
	s.obs.follow(r.rec)
	defer s.obs.follow(nil)
	sc.run(r)
	return r.rec.trace(s.obs.state(r.rec)), r.err
}

func (r *run) vol(i int) string { return r.vols[i] }

// do runs one step unless an earlier one failed.
func (r *run) do(what string, step func(ctx context.Context) error) {
	if r.err != nil {
		return
	}
	if err := step(r.ctx); err != nil {
		r.err = fmt.Errorf("%s: %w", what, err)
	}
}

// apply is the driver's writer applying changes as its queue does: a
// Conflict is retried at once, and an InFlight (KubeVirt still working off
// an earlier request of the VM) again until it is not. Whether a Conflict
// comes at all is timing (a test-guarded write raced one of KubeVirt's
// status writes), so it is not recorded; an InFlight is, once however often
// it repeats.
func (r *run) apply(what string, changes ...hotplug.Change) {
	r.do(what, func(ctx context.Context) error {
		pending := changes
		return testwait.Poll(ctx, what, func() (bool, string, error) {
			outs := r.s.w.Apply(ctx, r.vm, pending)
			var again []hotplug.Change // only these are retried, as the queue does
			for i, o := range outs {
				if o.Result == hotplug.Conflict || o.Result == hotplug.InFlight {
					again = append(again, pending[i])
				}
				if o.Result != hotplug.Conflict {
					r.rec.answer(fmt.Sprintf("%s: %s %s: %s", what, pending[i].Op, pending[i].Volume, o.Result), o.Err)
				}
			}
			pending = again
			return len(again) == 0, fmt.Sprint(outs), nil
		})
	})
}

// addVolume and removeVolume call virt-api's VM subresources directly,
// for KubeVirt's own answer.
func (r *run) addVolume(what, vol string) {
	if r.err != nil {
		return
	}
	err := r.s.kv.KubevirtV1().VirtualMachines(r.s.h.Namespace).AddVolume(r.ctx, r.vm, &kubevirtv1.AddVolumeOptions{
		Name: vol,
		Disk: &kubevirtv1.Disk{Name: vol, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusSCSI}}},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: vol},
			Hotpluggable:                      true,
		}},
	})
	r.rec.answer(what+" "+vol, err)
}

func (r *run) removeVolume(what, vol string) {
	if r.err != nil {
		return
	}
	err := r.s.kv.KubevirtV1().VirtualMachines(r.s.h.Namespace).RemoveVolume(r.ctx, r.vm, &kubevirtv1.RemoveVolumeOptions{Name: vol})
	r.rec.answer(what+" "+vol, err)
}

// until waits for cond on the observer's cached VM, VMI and the scenario's
// attachment pods.
func (r *run) until(what string, cond func(*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineInstance, []*corev1.Pod) bool) {
	r.do(what, func(ctx context.Context) error {
		return testwait.Poll(ctx, what, func() (bool, string, error) {
			vm, vmi, pods := r.s.obs.objects(r.rec)
			ok := cond(vm, vmi, pods)
			return ok, strings.Join(r.s.obs.state(r.rec), "; "), nil
		})
	})
}

// settle waits until KubeVirt is done: the VM and a running VMI hold
// exactly want, each Ready, no request pending, and the running attachment
// pods hold exactly want, none starting or terminating.
func (r *run) settle(want ...string) {
	sort.Strings(want)
	r.until("settled on ["+strings.Join(want, " ")+"]", func(vm *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance, pods []*corev1.Pod) bool {
		if vm == nil || vm.Spec.Template == nil || len(vm.Status.VolumeRequests) > 0 || !slices.Equal(hotplugNames(vm.Spec.Template.Spec.Volumes), want) {
			return false
		}
		if vmi == nil || vmi.DeletionTimestamp != nil || vmi.Status.Phase != kubevirtv1.Running || !slices.Equal(hotplugNames(vmi.Spec.Volumes), want) {
			return false
		}
		var ready []string
		for _, e := range vmi.Status.VolumeStatus {
			if e.Name == bootVolume {
				continue
			}
			if e.Phase != kubevirtv1.VolumeReady {
				return false
			}
			ready = append(ready, e.Name)
		}
		sort.Strings(ready)
		if !slices.Equal(ready, want) {
			return false
		}
		held := map[string]bool{}
		for _, p := range pods {
			if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
				return false
			}
			for _, v := range podVolumes(p) {
				held[v] = true
			}
		}
		return len(held) == len(want) && !slices.ContainsFunc(want, func(v string) bool { return !held[v] })
	})
}

// hotplugNames are the volumes other than the boot disk, sorted.
func hotplugNames(vols []kubevirtv1.Volume) []string {
	var names []string
	for _, v := range vols {
		if v.Name != bootVolume {
			names = append(names, v.Name)
		}
	}
	sort.Strings(names)
	return names
}
