# thin pool over an md array: reshape the array under the pool, pool-resize, snapshots, kill -9
D=/tmp/probe-life/t10; P=21113; rm -rf $D; source /tmp/probe-life/lib.sh; mkcfg; start_svc
mk create r5 --level raid5 --raid-devices 3 --chunk 64K --member-size 128M --assume-clean $D/m{0,1,2}.img >/dev/null
truncate -s 128M $D/m3.img
mk thin pool-create pool --metadata $D/pool.meta --metadata-size 16M --data volume:r5 | head -2
mk thin create pool 0 --size 1G --export t0 | head -1
writer t0 60000 $D/w.log 1000
sleep 2
mk thin snapshot pool 1 0 | head -1
mk attr r5 sync_speed_max=20000 >/dev/null
mk grow r5 --raid-devices 4 --add $D/m3.img | head -1
sleep 2; kill9_svc; start_svc; state r5; mk thin status pool | head -5
mk attr r5 sync_speed_max=200000 >/dev/null
for i in $(seq 60); do s=$(state r5); echo "$s" | grep -q reshap || break; sleep 2; done; state r5
mk thin pool-resize pool | head -3
mk thin snapshot pool 2 1 | head -1
mk thin status pool | head -8
kill -TERM $SVC; wait $SVC; start_svc
mk thin list pool
kill $WR; wait $WR; cat $D/w.log.out
verify t0 $D/w.log; echo verify rc $?
stop_svc
thin_check $D/pool.meta; echo thin_check rc $?
