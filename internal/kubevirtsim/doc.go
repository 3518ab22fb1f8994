// Package kubevirtsim simulates the parts of KubeVirt (and a little of
// Harvester and Longhorn) that volume hotplug depends on, on top of a real
// kube-apiserver, for a named KubeVirt release (Version: v1.5.3, v1.6.3,
// v1.6.6, v1.7.0, v1.7.4, v1.8.2 or main). It reproduces what KubeVirt's source does at
// that tag, stuck states included; file:line references below are
// kubevirt/kubevirt paths at the tag named.
//
// # Who does what
//
// One type per simulated component, each with its own state and lock,
// sharing only the informers and clients (cluster.go):
//
//   - vmController (vmcontroller.go), virt-controller's VM controller:
//     start and stop; the legacy volumeRequests pass (per VM, in order, the
//     VMI subresource first, then the VM spec update with the cached
//     resourceVersion, the trim and the status, per-VM exponential backoff;
//     the first error aborts the pass and becomes the Failure condition);
//     the declarative controller.
//   - vmiController (vmicontroller.go), virt-controller's VMI controller:
//     scheduling, the one attachment pod (hp-volume-xxxxx) per VMI that
//     holds its whole hotplug set, and the attach and detach side of
//     volumeStatus (volumestatus.go controllerVolumeStatus).
//   - virtHandler (handler.go), virt-handler and virt-launcher: the
//     start of the domain and the shutdown of a deleted VMI here; each
//     hotplug pass (mounting from the attachment pods, the domain's disks
//     through DiskHook, unmounting, the node side of volumeStatus) is
//     internal/virthandler's, per release and with its known faults, the
//     same model the real control plane's node agents run.
//   - kubelet (kubelet.go): attachment pods start after every claim they
//     mount is bound, sooner when the host node has every volume attached
//     already than when one needs an attach, later the more volumes they
//     hold past 50 (podStartDelay). With Options.Kubelets it stands
//     aside: real kubelets on host nodes run the pods, a real scheduler
//     places them, and the VMI controller writes a virt-launcher pod per
//     VMI and its attachment pods as KubeVirt renders them (launcher.go).
//   - provisioner (provisioner.go) and snapshotter (snapshot.go): the host
//     "Longhorn" class, the PV/PVC protection controllers, resizes,
//     VolumeSnapshots and restores (SnapshotHook), clones of a PVC
//     (clone.go, CloneHook) refused as external-provisioner and Longhorn
//     refuse them.
//   - The VM and VMI CRDs (install.go diskLimitSchema): KubeVirt's limit
//     of 256 disks and volumes, enforced by the API server itself.
//   - backupper (backup.go): Harvester's VolumeRemoteBackup and
//     VolumeRemoteRestore controllers (a backup is a snapshot of the backup
//     class plus Timings.Backup of upload; a restore is a pre-provisioned
//     snapshot of the backup's handle plus Timings.Restore of download, and
//     a PVC restored from it, reading the backup snapshot's data), and the
//     garbage collection of what they own.
//   - virtAPI (subresource.go) behind the front proxy (proxy.go): PUT
//     .../virtualmachines|virtualmachineinstances/{name}/addvolume|removevolume
//     with virt-api's checks in its order, codes and messages, after a
//     SelfSubjectAccessReview for the caller; everything else is proxied
//     (watches stream) and counted (Stats).
//   - migrationController (migration.go): virt-controller's migration
//     controller and virt-handler's source and target sides of a live
//     migration, for VirtualMachineInstanceMigrations (Sim.Migrate).
//   - webhooks (webhook.go, webhook_vmi.go): real validating webhooks on
//     127.0.0.1: the VM status validator (WebhookVMStatus), the VM
//     validator's snapshot rule (WebhookVM), the VMI update validator's
//     hotplug storage rules (WebhookVMIUpdate) and a Harvester-like volume
//     denial (WebhookHarvester).
//
// The test API (testapi.go: CreateVM, CreatePVC, Wait, WaitVolumeReady...)
// creates and watches objects; Faults (faults.go, sim.Faults()) injects
// failures. No scheduler, kubelet or kube-controller-manager is needed.
//
// # Versions and modes
//
// Mode picks the gates written to the KubeVirt CR; at run time the
// simulator follows the CR, and HotplugVolumes wins when both gates are on
// (v1.7.0 pkg/virt-controller/watch/vm/vm.go:3441).
// DeclarativeHotplugVolumes exists from v1.6.0 on
// (pkg/virt-config/featuregate/active.go:104) and is Beta, on by default,
// on main (active.go:311); v1.5.3 refuses ModeDeclarative. The hotplug
// code is the same in v1.6.3 and v1.7.0; Harvester 1.7 runs v1.6.3 with the
// legacy gate, Harvester 1.8 v1.7.0 with the declarative one. v1.6.6
// (Harvester 1.7.2) and v1.7.4 (Harvester 1.8.2) are v1.6.3 and v1.7.0 with
// PR 16159 (behaviour 1); nothing else in their hotplug paths differs in
// what a driver sees.
//
// # Behaviours, per version
//
// 1. Re-add while the old entry is Detaching sticks (v1.5.3, v1.6.3,
// v1.7.0; also v1.8.0 and v1.8.1, not simulated). An entry whose volume is
// back in the spec moves to AttachedToNode only from "", Pending or Bound
// (v1.7.0 pkg/virt-controller/watch/vmi/volume-hotplug.go:228 and
// storage.go:205; v1.5.3 vmi/vmi.go:2158), so once an attachment pod
// holding the whole set exists the entry stays Detaching; virt-handler
// mounts the volume and still does not touch it (v1.7.0
// pkg/virt-handler/vm.go:443). v1.8.2 and main reset a Detaching entry of
// a volume in the spec to its PVC phase (v1.8.2 storage.go:199-206, PR
// 17139) and recover. KubeVirt deletes attachment pods with grace period 0
// (v1.7.0 volume-hotplug.go:351-353; the pod template's own grace period is
// 0 too, pkg/virt-controller/services/template.go:1027), which the API
// server executes at once, so the window is the one virt-controller pass
// between writing Detaching and dropping the entry. PR 16159 (v1.6.4,
// v1.7.1, v1.8.0) stops counting a pod being deleted as the current one
// (v1.8.2 volume-hotplug.go:59; up to v1.7.0 it counts, v1.7.0
// volume-hotplug.go:52); with grace period 0 only a pod someone else
// deletes, or a finalizer holds, is ever seen in that state.
//
// 2. Re-add while the entry is UnMountedFromPod stays UnMountedFromPod,
// every version: canMoveToAttachedPhase refuses it (as above) and the
// current pod matches the set, so virt-controller never looks at pods
// (volume-hotplug.go:41 needsHandleHotplug) and the domain never takes a
// disk that is not MountedToPod or Ready (v1.7.0
// pkg/virt-launcher/virtwrap/converter/converter.go:1780). v1.8.2's reset
// covers Detaching only.
//
// 3. A change of the hotplug set resets volumes in flight, every version.
// The status update looks for the pod that holds every hotplug volume of
// the spec (v1.7.0 storage.go:145-156; v1.5.3 vmi.go:2012-2023); while
// there is none, every entry not yet Ready, MountedToPod included, falls
// back to its PVC phase with attachPodUID cleared (storage.go:187-196).
// virt-handler marks a still-mounted volume MountedToPod again on its next
// pass (its IsMounted looks at virt-launcher only,
// pkg/virt-handler/hotplug-disk/mount.go:809), so such an entry flips
// between the two until a pod holds the set again.
//
// 4. Claims, every version. Any existing claim is ready to attach, bound
// or not (pkg/storage/types/pvc.go:223-251 and CDI's
// IsSucceededOrPendingPopulation, which only asks about claims a
// DataVolume owns): an unbound claim goes into the attachment pod, the pod
// cannot be scheduled, and every other new volume of the VM waits in
// AttachedToNode behind it (the pending pod holds the set). A missing
// claim aborts the hotplug pass for the whole VMI before any pod is
// created or deleted, "Error determining volume status didn't find PVC
// <claim>" (v1.7.0 volume-hotplug.go:141, v1.5.3 vmi.go:1739; KubeVirt
// only logs it and requeues, and so does the simulator): new volumes stay
// in their PVC phase, a removed one never leaves Detaching. Its own entry
// reads Pending/FailedPvcNotFound "PVC <claim> not found" (v1.6.3
// storage.go:282) or, on v1.5.3, "Unable to determine PVC name"
// (vmi.go:2178).
//
// 5. Old attachment pods (v1.7.0 volume-hotplug.go:74-120; v1.5.3
// vmi.go:1695; main volume-hotplug.go:77-101). No new pod while an old one
// is Pending (volume-hotplug.go:161, hasPendingPods at 379); pending old
// pods are deleted; while the current pod is not Running the newest
// running old pod is kept (every version; on main only if it still holds
// a volume of the spec or a removed one not yet unmounted,
// podContainsVolumesToPreserve at 144); from v1.6 on an old pod holding a
// removed volume still Ready or MountedToPod stays until virt-handler has
// unmounted it, and such an entry keeps its phase meanwhile (v1.7.0
// storage.go:268 phaseForUnpluggedVolume); v1.5.3 writes Detaching at
// once and deletes the pod without waiting (vmi.go:2114, 1695).
//
// 6. VM stop and start. A deleted VMI lives on for its grace period,
// spec.terminationGracePeriodSeconds or 30 s
// (staging/src/kubevirt.io/api/core/v1/types.go:39, enforced by v1.7.0
// pkg/virt-handler/vm.go:1557): the simulated guest never acts on ACPI, so
// it takes all of it (times Options.Scale). From v1.6 on virt-handler
// starts the domain (phase Running) only once every hotplug entry is
// MountedToPod or Ready (hotplugVolumesReady, v1.6.3 vm.go:2034, v1.7.0
// vm.go:2047, v1.8.2 vm.go:1960); v1.5.3 starts at once.
//
// 7. Declarative controller (v1.6 on, pkg/storage/hotplug/hotplug.go, the
// same at every tag): only while the VMI runs, one compare-and-swap JSON
// patch of the VMI's volumes and disks (hotplug.go:51-93) removes hotplug
// volumes missing from the VM or changed there (a changed disk alone does
// not count, hotplug.go:95-120) and adds those the VMI has neither in its
// spec nor in volumeStatus (hotplug.go:122-147). The controller checks no
// bus itself: the VMI update validator (v1.7.0
// pkg/storage/admitters/storagehotplug.go:36, called from
// vmi-update-admitter.go:179; v1.5.3 vmi-update-admitter.go:144) judges the
// whole patch, so one bad disk holds back every change of the VM, with
// `admission webhook "virtualmachineinstances-update-validator.kubevirt.io"
// denied the request: <message>`. Any failed patch (a denial, or 422 "the
// server rejected our request due to an error in our request" when the VMI
// moved on) becomes the VM's Failure condition, reason HotPlugVolumeError,
// "Error encountered while handling declarative hotplug volumes: <err>"
// (v1.7.0 pkg/virt-controller/watch/vm/vm.go:3216-3217, 2767).
//
// 8. Exact strings. A failed legacy spec update reads "Error encountered
// when trying to update vm according to add volume and/or memory dump
// requests: <err>" (reason FailedUpdateError) at every tag (vm.go: v1.5.3
// 3147, v1.6.3 3247, v1.7.0 3254, v1.8.2 3340, main 3390); a claim in
// phase Lost reads "PVC is in phase Lost" (v1.5.3 vmi.go:2186, v1.7.0
// storage.go:296).
//
// The contract tests (contract_test.go) pin each of these per version.
//
// # Races
//
// Where KubeVirt races, the simulator takes the side that sticks. Its
// VMI controller creates an attachment pod and then, in the same pass,
// writes volumeStatus (v1.7.0 lifecycle.go:215 then storage.go:151, reading
// the pod cache): the simulator lets that status update see the pod it just
// created, as it does when the informer delivers the pod first (the
// interleaving PR 17139 describes). So a new entry goes straight to
// AttachedToNode, and a stale Detaching one is never reset on v1.5.3 to
// v1.7.0. Both components write the VMI status guarded by its
// resourceVersion and retry on a conflict.
//
// # Time
//
// Every latency is a field of Timings, multiplied by Options.Scale (tests
// use 0.05) and spread by Options.Jitter. The defaults follow observed
// KubeVirt: virt-api calls take milliseconds, a reconcile tens of
// milliseconds, an attachment pod 2.5 s from creation to Ready when its
// volumes are attached on its node already and 10 s when one needs an
// attach (scheduling, CSI attach, kubelet mount), plus a creation cost
// growing with the square of its volumes past 50, mounting into
// virt-launcher 0.1 s, the domain attach 1.5 s, an unplug 0.5 s
// (internal/virthandler DefaultTimings); virt-handler looks again every
// second while a hotplug entry has no target (v1.7.0 vm.go:652), and a
// failed pass backs off 5 ms doubling to 1000 s (Timings.BackoffMax,
// vm.go:145). Steps fire when their deadline has come, however often a
// component looks. Backup and Restore (2 s each) stand for a small volume's
// upload to and download from the backup target; they only need to be long
// enough that a caller sees the backup or restore in progress first.
//
// # Not simulated
//
// Pre-provisioned snapshots (other than a restore's from a backup), default
// snapshot classes, the snapshot source-protection finalizers, Harvester's
// webhooks for backups (a restore of a missing backup is refused there; here
// its controller reports the error), DataVolumes (a DataVolume source
// is a claim of the same name), the VMI update validator's service-account
// rule and CPU/memory checks, virt-launcher pods without Options.Kubelets
// (a live migration, migration.go, plays its phases and what they do to
// hotplug, not the transfer) and memory dumps.
package kubevirtsim
