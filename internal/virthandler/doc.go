// Package virthandler is KubeVirt's virt-handler, the node agent, as each
// release ships it, for hot-plugged volumes: one model that both the
// simulated control plane (internal/kubevirtsim) and KubeVirt's real
// virt-controller and virt-api (internal/realkubevirt) drive, so a release
// behaves the same under both. The caller brings the transport (informers,
// status writes, queues); Handler.Sync is one pass over one running VMI.
//
// A pass follows virt-handler's order (v1.7.0 pkg/virt-handler/vm.go:1932
// vmUpdateHelperDefault): mountFromPod over every hotplug entry of the
// status, the domain sync (unplug the disks of removed volumes, plug the
// mounted ones whose entry is MountedToPod or Ready), Unmount of what left
// the spec (handleHousekeeping, vm.go:2140), then the status
// (updateHotplugVolumeStatus, vm.go:474), written even when the pass
// failed, with the targets of the domain as the pass found it (vm.go:1488).
//
// What releases differ in (Release, from ForVersion), paths in
// kubevirt/kubevirt at the tag named:
//
//	behaviour                                   tags that have it                 fixed in
//	first-UID reuse in mountFromPod             v1.5.2 mount.go:330, v1.6.0-      v1.9.0 (PR 18105,
//	  (a new volume sorting after another         v1.6.6 :326, v1.7.0/v1.7.4       mount.go:362-366)
//	  pod's entry is looked up in that pod:       :345, v1.8.2/v1.8.4 :349
//	  HotplugFailed, vm.go:1995)
//	removed volumes mounted again               every tag, v1.9.0 included        main (PR 18044)
//	Unmount stops at its first failing path     v1.6.0 mount.go:677-691, v1.7.0   v1.9.0 (PR 16742)
//	                                              :696-712, v1.8.2 :723-739
//	any mount error fails the pass              v1.5.2 vm.go:3111-3113            v1.6.0 (vm.go:1976-1981
//	  (no HotplugFailed tolerance)                                                  tolerates not-exist)
//
// Patch releases of a line do not differ in these paths (v1.6.0, v1.6.3 and
// v1.6.6; v1.7.0 and v1.7.4; v1.8.2 and v1.8.4: vm.go changes only in
// migration, shutdown and PCI-topology code, mount.go only in the socket
// path of filesystem volumes), so ForVersion keys on the minor release;
// docs/architecture.md, "KubeVirt patch levels per Harvester release", has
// the diff.
//
// The same in every tag: a disk is in the domain only while its entry is
// MountedToPod or Ready (v1.7.0 pkg/virt-launcher/virtwrap/converter/
// converter.go:1780, v1.5.2 :1615, v1.9.0 :1174) and the domain sync
// detaches what the spec lacks (v1.7.0 virtwrap/manager.go:1363), so an
// entry virt-controller resets to its PVC phase right after its disk was
// attached loses the disk, and gets it back a pass later; virt-handler's
// queue backs off 5 ms doubling to 1000 s (vm.go:145); a domain paused on
// an I/O error has its updates delayed 10 s doubling to 3 min (vm.go:187,
// :1442-1448, retry_manager.go:83).
//
// The remount deadlock (kubevirt PR 18044) needs more than the remount:
// two removed volumes of one old attachment pod are unmounted in the pass
// that unplugs their disks, whose status still shows their targets, so they
// stay Ready; the next pass mounts the first again from the old pod and
// fails on the second, whose device in that pod vanished ("no device in",
// mount.go:103, not a not-exist error), before Unmount. The first stays
// mounted, IsMounted keeps it Ready, virt-controller keeps the old pod for
// it (v1.7.0 pkg/virt-controller/watch/vmi/volume-hotplug.go:99-111), and every
// pass repeats. Faults.SetDeviceVanished plays the vanished device,
// Faults.SetUnmountFails an unmount that fails.
package virthandler
